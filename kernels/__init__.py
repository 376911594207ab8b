"""switchhead.kernels: the CVMM expert-projection op (Triton kernels, their naive PyTorch twin, the dispatch).

`cvmm(inputs, expert_index, weight, gates=None, out_groups=1)` is what `switchhead`'s model calls for every
expert projection; see `cvmm.py` for the contract and the switches (`set_backend` / `SWITCHHEAD_CVMM_BACKEND`,
`set_deterministic` / `SWITCHHEAD_CVMM_DETERMINISTIC`). Triton is imported only when a Triton kernel first runs.
"""

from .cvmm import (
    CHECK_INDEX_ENV,
    BACKEND_ENV,
    BACKENDS,
    DETERMINISTIC_ENV,
    cvmm,
    get_backend,
    is_deterministic,
    resolve_backend,
    set_backend,
    set_deterministic,
    use_backend,
)
from .cvmm_reference import cvmm_backward_reference, cvmm_forward_reference, cvmm_naive

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "CHECK_INDEX_ENV",
    "DETERMINISTIC_ENV",
    "cvmm",
    "cvmm_backward_reference",
    "cvmm_forward_reference",
    "cvmm_naive",
    "get_backend",
    "is_deterministic",
    "resolve_backend",
    "set_backend",
    "set_deterministic",
    "use_backend",
]
