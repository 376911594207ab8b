"""Not a package: the repository root.

Python imports this file only when it runs from the folder that holds a checkout named `switchhead` (the clone's
default name): the folder then shadows the installed package of that name. The import is handed over to the
installed `switchhead` (an editable install of this checkout included); where none is installed, it fails with one
line saying what to do.
"""

if __name__ == "switchhead":
    import importlib as _importlib
    import os as _os
    import sys as _sys

    # the folder Python found this checkout in (a link named switchhead counts: resolve only after going up)
    _holder = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _saved_path = list(_sys.path)
    _sys.modules.pop("switchhead", None)
    _sys.path[:] = [entry for entry in _saved_path if _os.path.realpath(entry or _os.curdir) != _holder]
    try:
        _real = _importlib.import_module("switchhead")
    except ImportError as error:
        raise ImportError(
            f"the folder {_os.path.dirname(_os.path.realpath(__file__))} (a checkout of switchhead) shadows the "
            f"package here, and switchhead is not installed: run `pip install -e {_os.path.dirname(__file__) or '.'}` "
            f"or run Python from another directory", name="switchhead") from error
    finally:
        _sys.path[:] = _saved_path
    if _os.path.realpath(getattr(_real, "__file__", None) or "") == _os.path.realpath(__file__):
        raise ImportError("the repository root is not the switchhead package: install it with `pip install -e .`",
                          name="switchhead")
    _sys.modules["switchhead"] = _real  # the import statement returns what sys.modules holds once this file has run
