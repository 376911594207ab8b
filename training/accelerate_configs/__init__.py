"""Accelerate configuration files shipped with the package (FSDP2, full or sharded state dicts).

    accelerate launch --config_file "$(python -c 'from switchhead.training.accelerate_configs import path; print(path("fsdp2"))')" \
        -m switchhead.cli train --preset wt103-47m-switchhead-xl --data DIR

`path(name)` gives the file of `name` ("fsdp2", "fsdp2_sharded").
"""

from __future__ import annotations

import os
import sys

CONFIGS = ("fsdp2", "fsdp2_sharded")


def path(name: str) -> str:
    """The YAML file of the shipped configuration `name`."""
    if name not in CONFIGS:
        raise ValueError(f"unknown accelerate config {name!r}; choose one of: {', '.join(CONFIGS)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.yaml")

