"""The top-level `kernels/` folder and Hugging Face's `kernels` package.

Python started from the repository root (a notebook, `python -c`) has the root on sys.path, so `import kernels`
finds our folder, whose import name is `switchhead.kernels`, before the `kernels` package that Transformers and
bitsandbytes import for hub kernels ("cannot import name 'get_kernel' from 'kernels'"). The folder hands such an
import over to the installed package, and where there is none, it stays an empty placeholder whose names raise one
line saying why, while Transformers' probe (find_spec, import, `__version__`) still answers "not available"."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _from_the_root(code: str, *flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if pythonpath is not None:  # entries after the script's directory: the root still comes first
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _installed_kernels() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.integration
def test_without_the_package_the_folder_is_a_placeholder_that_says_why():
    # -S: no site-packages, so no `kernels` package can be installed; only the root's folder is found
    result = _from_the_root("""
        import importlib.util, json, sys
        spec = importlib.util.find_spec("kernels")
        import kernels
        out = {"spec": spec.origin, "file": kernels.__file__, "version": getattr(kernels, "__version__", "N/A"),
               "ours_ran": sorted(name for name in sys.modules if name.startswith("kernels."))}
        try:
            from kernels import get_kernel
        except ImportError as error:
            out["error"] = str(error)
        print(json.dumps(out))
    """, "-S")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["spec"] == out["file"] == str(ROOT / "kernels" / "__init__.py")
    assert out["version"] == "N/A" and out["ours_ran"] == []  # none of cvmm.py ran under the wrong name
    message = out["error"]
    assert "\n" not in message
    assert message.startswith("cannot import name 'get_kernel' from 'kernels': ")
    for part in (str(ROOT / "kernels"), "switchhead.kernels", "repository root", "pip install kernels"):
        assert part in message


@pytest.mark.integration
def test_transformers_probe_and_our_model_from_the_root():
    """Transformers imports whatever find_spec("kernels") names when no distribution claims it: the probe must
    answer like a missing package (or like the installed one), and the model must still import and run."""
    result = _from_the_root("""
        import json, torch
        from transformers.utils import is_kernels_available
        available = is_kernels_available()
        import kernels, switchhead, switchhead.kernels
        model = switchhead.SwitchHeadForCausalLM(switchhead.SwitchHeadConfig.from_preset("tiny-switchhead"))
        logits = model(torch.zeros(1, 4, dtype=torch.long)).logits
        print(json.dumps({"available": available, "top": kernels.__file__, "ours": switchhead.kernels.__file__,
                          "finite": bool(logits.isfinite().all())}))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ours"] == str(ROOT / "kernels" / "__init__.py") and out["finite"]
    if _installed_kernels():  # handed over: the top-level name is the installed package
        assert out["top"] != out["ours"]
    else:
        assert out["available"] is False and out["top"] == out["ours"]


@pytest.mark.integration
def test_an_installed_kernels_package_gets_the_import(tmp_path):
    """A stand-in distribution (a package plus its dist-info) after the root on sys.path, as a pip-installed one
    is: `from kernels import get_kernel` gets it, and switchhead.kernels stays ours, a different module."""
    package = tmp_path / "kernels"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '0.0.1'\n\ndef get_kernel(name, version=None):\n"
                                         "    return 'hub kernel ' + name\n")
    (package / "layers.py").write_text("KIND = 'hub layers'\n")
    info = tmp_path / "kernels-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n")
    result = _from_the_root("""
        import json, sys
        from kernels import get_kernel
        import kernels.layers
        import switchhead.kernels
        print(json.dumps({"got": get_kernel("x"), "file": sys.modules["kernels"].__file__,
                          "layers": kernels.layers.KIND, "ours": switchhead.kernels.__file__,
                          "cvmm": hasattr(switchhead.kernels, "cvmm")}))
    """, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"got": "hub kernel x", "file": str(package / "__init__.py"), "layers": "hub layers",
                   "ours": str(ROOT / "kernels" / "__init__.py"), "cvmm": True}
