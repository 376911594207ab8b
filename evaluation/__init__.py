"""switchhead.evaluation (work in progress)."""
