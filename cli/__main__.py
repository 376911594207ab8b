"""`python -m switchhead.cli COMMAND ...`: the `switchhead` console script."""

import sys

from switchhead.cli import main

sys.exit(main())
