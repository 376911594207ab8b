"""switchhead.kernels: the CVMM expert-projection op on Triton.

`cvmm(inputs, expert_index, weight, gates=None, out_groups=1)` is the "cvmm" entry of the model's one dispatch table
(`switchhead.expert_ops.EXPERTS_IMPLEMENTATIONS`) where `triton_runs`; see `cvmm.py` for the contract and the switch
`set_deterministic` / `SWITCHHEAD_CVMM_DETERMINISTIC` (slots summed in a fixed order unless atomics are asked for).
The Transformers experts function "cvmm" that runs it for any MoE model is the model's
(`switchhead.experts_integration`). Triton is imported only when a Triton kernel first runs.
"""

if __name__ == "kernels":
    # This folder was found as the top-level `kernels` because the repository root is on sys.path (Python started
    # there), while that name belongs to Hugging Face's `kernels` package, which Transformers and bitsandbytes import.
    # Nothing of ours runs under this name (our code is `switchhead.kernels`). Where that package is installed, the
    # import is handed over to it; where it is not, this stays an empty placeholder whose names raise one line
    # saying why. (`import kernels` itself has to succeed: Transformers probes for the package with find_spec, which
    # sees this folder, then imports it and reads `__version__`.)
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _elsewhere = [entry for entry in _sys.path if _os.path.realpath(entry or _os.curdir) != _checkout]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.origin is not None and _spec.loader is not None:  # not a bare (namespace) folder
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds once this file has run
        try:
            _spec.loader.exec_module(_real)
        except BaseException:
            _sys.modules.pop("kernels", None)
            raise
    else:
        _SHADOWED = (f"{_os.path.join(_checkout, 'kernels')} is switchhead's kernel folder (switchhead.kernels), "
                     f"imported as `kernels` only because Python runs from the repository root, and Hugging Face's "
                     f"`kernels` package is not installed: pip install kernels, or run from another directory")

        def __getattr__(name: str):
            if name.startswith("__") and name.endswith("__"):  # getattr(module, "__version__", default) still works
                raise AttributeError(name)
            raise ImportError(f"cannot import name {name!r} from 'kernels': {_SHADOWED}", name="kernels")

    del _machinery, _util, _os, _sys, _checkout, _elsewhere, _spec
else:
    from .cvmm import (CHECK_INDEX_ENV, DETERMINISTIC_ENV, SlotOrder, cvmm, is_deterministic, set_deterministic,
                       sort_slots, triton_runs)

    __all__ = ["CHECK_INDEX_ENV", "DETERMINISTIC_ENV", "SlotOrder", "cvmm", "is_deterministic", "set_deterministic",
               "sort_slots", "triton_runs"]
