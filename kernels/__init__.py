"""switchhead.kernels (work in progress)."""
