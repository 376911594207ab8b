"""A clean virtual environment with only torch, Transformers (the release under test) and safetensors: where a
saved folder must load with `trust_remote_code=True` without this package. Built once and cached."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from helpers.transformers_suite import cache_root

TORCH_PIN = "torch==2.13.0"  # the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build
REQUIREMENTS = [TORCH_PIN, f"transformers=={transformers.__version__}", "safetensors"]


def run_checked(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return result


def clean_venv() -> Path:
    """The cached clean environment's python executable, building the environment if needed."""
    name = f"clean-venv-torch{torch.__version__.split('+')[0]}-transformers{transformers.__version__}"
    root = cache_root() / name
    python = root / "bin" / "python"
    if (root / ".complete").is_file():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").is_file():
            return python
        shutil.rmtree(root, ignore_errors=True)  # an interrupted build: start again
        run_checked([sys.executable, "-m", "venv", str(root)])
        run_checked([str(python), "-m", "pip", "install", "--quiet", *REQUIREMENTS])
        (root / ".complete").write_text("\n".join(REQUIREMENTS) + "\n")
    return python
