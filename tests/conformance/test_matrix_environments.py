"""scripts/compat_matrix.py's environments see the packages of the interpreter that runs the matrix:
`bash scripts/test.sh` inside a virtual environment used to build them with `venv --system-site-packages`,
which exposes the *base* interpreter's packages, so every run there failed with "No module named 'switchhead'".

Each test builds real environments with the script's own `create_env` (a few seconds each: venv runs ensurepip)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# run by the interpreter under test: the matrix's environment-creation code, then the new environment's python
BUILD_AND_LOOK = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import compat_matrix
    site_dirs = compat_matrix.running_site_dirs()
    python = compat_matrix.create_env(Path(sys.argv[2]), site_dirs)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "in_both.py").write_text("WHERE = 'matrix environment'\\n")  # as a pinned transformers would be
    look = subprocess.run([str(python), "-c", sys.argv[3]], capture_output=True, text=True)
    print(json.dumps({"site_dirs": site_dirs, "python": str(python), "rc": look.returncode, "out": look.stdout,
                      "err": look.stderr[-2000:]}))
""")


def _build_and_look(interpreter: str, inner: Path, code: str) -> dict:
    result = subprocess.run([interpreter, "-c", BUILD_AND_LOOK, str(SCRIPTS), str(inner), code],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, report["err"]
    return report


def _purelib(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


@pytest.mark.integration
def test_an_environment_built_inside_a_virtual_environment_sees_that_environments_packages(tmp_path):
    """The reported case: the matrix runs inside a user's virtual environment, whose packages the base interpreter
    does not have. The new environment must see them (a plain module, one reached only through a .pth file, as an
    editable install is), its own copy of a package first, and have a pip of its own to install the pins with."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True, timeout=120)
    outer_python = outer / "bin" / "python"
    outer_site = _purelib(outer_python)
    (outer_site / "only_in_outer.py").write_text("WHERE = 'outer'\n")
    (outer_site / "in_both.py").write_text("WHERE = 'outer'\n")
    source = tmp_path / "editable_source"
    source.mkdir()
    (source / "through_a_pth.py").write_text("WHERE = 'editable'\n")
    (outer_site / "editable_like.pth").write_text(f"{source}\n")

    inner = tmp_path / "inner"
    code = ("import json, only_in_outer, through_a_pth, in_both, pip, sys; print(json.dumps([only_in_outer.WHERE, "
            "through_a_pth.WHERE, in_both.WHERE, pip.__file__, sys.prefix]))")
    report = _build_and_look(str(outer_python), inner, code)
    assert str(outer_site.resolve()) in report["site_dirs"]
    only, editable, both, pip_file, prefix = json.loads(report["out"])
    assert (only, editable, both) == ("outer", "editable", "matrix environment")
    assert Path(pip_file).resolve().is_relative_to(inner.resolve())  # its own pip: installs land in it
    assert Path(prefix).resolve() == inner.resolve()


@pytest.mark.integration
def test_an_environment_built_by_this_interpreter_imports_what_this_run_imports(tmp_path):
    """Whatever runs the tests (the system interpreter in CI, a virtual or conda environment elsewhere): the new
    environment imports switchhead (an editable install), pytest and torch from the same files as this run."""
    import pytest
    import torch

    import switchhead

    code = ("import json, switchhead, pytest, torch; "
            "print(json.dumps([switchhead.__file__, pytest.__file__, torch.__file__]))")
    report = _build_and_look(sys.executable, tmp_path / "inner", code)
    seen = [Path(path).resolve() for path in json.loads(report["out"])]
    assert seen == [Path(module.__file__).resolve() for module in (switchhead, pytest, torch)]
