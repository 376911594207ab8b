"""switchhead.training (work in progress)."""
