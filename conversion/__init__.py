"""switchhead.conversion (work in progress)."""
