"""The README's set-up scripts (scripts/demo.sh, scripts/test.sh) install pinned packages; outside a virtual
environment they refuse with one line and exit 2 before pip runs, unless SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs bash

REPO = Path(__file__).resolve().parents[2]


def _python_outside_any_venv(tmp_path: Path) -> Path:
    """A `python` on PATH that is the base interpreter (no venv), logging every call's arguments."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    folder = tmp_path / "bin"
    folder.mkdir()
    stub = folder / "python"
    # pip never runs for real: the base interpreter's packages must not change, whatever the script does
    stub.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path / "calls.txt"}"\n'
                    f'case "$*" in *"-m pip"*) exit 97;; esac\nexec "{base}" "$@"\n')
    stub.chmod(0o755)
    return folder


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/test.sh"])
def test_setup_script_refuses_a_python_outside_a_virtual_environment(script, tmp_path):
    folder = _python_outside_any_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SWITCHHEAD_ALLOW_SYSTEM_PYTHON")}
    env["PATH"] = f"{folder}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(["bash", str(REPO / script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and "virtual environment" in lines[0]
    assert "python -m venv .venv" in lines[0] and "SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1" in lines[0]
    calls = (tmp_path / "calls.txt").read_text() if (tmp_path / "calls.txt").exists() else ""
    assert "pip" not in calls, calls  # nothing was installed


def test_the_override_and_a_virtual_environment_pass_the_check(tmp_path):
    folder = _python_outside_any_venv(tmp_path)
    check = f'source "{REPO / "scripts" / "require_venv.sh"}"; require_venv x; echo passed'
    outside = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}
    allowed = subprocess.run(["bash", "-c", check], env={**outside, "SWITCHHEAD_ALLOW_SYSTEM_PYTHON": "1"},
                             capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 0 and allowed.stdout.strip() == "passed", allowed
    if sys.prefix != sys.base_prefix:  # the interpreter running the tests is in a venv: it passes as it is
        inside = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        inside.pop("SWITCHHEAD_ALLOW_SYSTEM_PYTHON", None)
        result = subprocess.run(["bash", "-c", check], env=inside, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == "passed", result


def test_ci_runs_the_tests_in_a_virtual_environment_of_its_own():
    text = (REPO / ".ci" / "run").read_text()
    assert "python3 -m venv .venv-ci" in text and "source .venv-ci/bin/activate" in text
    assert "SWITCHHEAD_ALLOW_SYSTEM_PYTHON" not in text
