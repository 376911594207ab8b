"""The machine a benchmark ran on, named the same way by every script in benchmarks/."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows, else "unknown CPU"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe(device, interpreted: bool = False) -> dict:
    """Machine, device (GPU name, CUDA and driver versions; or the CPU and its threads) and library versions."""
    import torch
    import transformers

    info = dict(machine=platform.node(), python=platform.python_version(), torch=torch.__version__,
                transformers=transformers.__version__, device_type=device.type)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["device"] = cpu_name() + (" (Triton interpreter)" if interpreted else "")
        info["threads"] = torch.get_num_threads()
    return info


def portable_path(path) -> str:
    """`path` as a results file records it: relative to the checkout when inside it (or `../...` beside it), else
    only its last component, so that no result names the folders of the machine that made it."""
    import os

    absolute = Path(os.path.abspath(path))
    repo = Path(__file__).resolve().parent.parent
    for base, prefix in ((repo, ""), (repo.parent, "../")):
        try:
            return prefix + absolute.relative_to(base).as_posix()
        except ValueError:
            continue
    return absolute.name


def file_slug(name: str) -> str:
    """A CPU or device name as part of a result file's name: lower case, other characters as '-', 40 at most."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")[:40]


def save_results(path: Path, report: dict, markdown: str) -> None:
    """`report` as JSON at `path` and `markdown` beside it (`.md`); the Markdown and both paths printed."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"saved {path} and {path.with_suffix('.md')}")


def gpu_or_smoke(script: str, cpu_smoke: bool):
    """The device a GPU benchmark runs on: CUDA, or the CPU for its `--cpu-smoke` run; None (after one line on
    stderr) where CUDA is asked for and absent."""
    import sys

    import torch

    if cpu_smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script}: error: no CUDA device; run with --cpu-smoke for the small CPU run", file=sys.stderr)
        return None
    return torch.device("cuda")


def result_path(out: Path | None, results: Path, stem: str, environment: dict, smoke: bool) -> Path:
    """`out`, else `results/<stem>_[smoke_]<device>.json`; its folder created."""
    path = out or results / f"{stem}_{'smoke_' if smoke else ''}{file_slug(environment['device'])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
