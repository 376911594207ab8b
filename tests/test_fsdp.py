"""FSDP2 training on CPU: 2 gloo processes (torchrun, `fully_shard` per decoder layer) against one process.

Accelerate enables FSDP only for accelerator device types (`AcceleratorState` keeps `MULTI_CPU` for gloo), so the
shipped Accelerate FSDP2 configs cannot run on this CPU machine; they are checked to parse into Accelerate's FSDP2
plugin with the model's wrap classes. The FSDP2 training itself is tested with torch's `fully_shard` directly, the
same wrapping Accelerate applies (tests/fsdp_worker.py): same losses as one process on the same global batch within
1e-5 (fp32), and a run killed with SIGKILL and resumed from its `torch.distributed.checkpoint` shards continues
with bitwise-identical losses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
STEPS = 8
COMMON = ["--steps", str(STEPS), "--preset", "tiny-switchall", "--no-entropy-reg"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env() -> dict:
    tests = str(Path(__file__).parent)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}


def torchrun(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), WORKER, str(out), *COMMON, *extra]


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    return [row["loss"] for row in rows]


def run(command, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fsdp2_matches_one_process_and_resumes_bitwise_after_sigkill(tmp_path):
    single, sharded, killed = tmp_path / "single", tmp_path / "fsdp", tmp_path / "killed"
    run([sys.executable, WORKER, str(single), *COMMON, "--no-fsdp"], single)
    run(torchrun(sharded, "--save-every", "2"), sharded)
    assert len(losses(sharded)) == STEPS
    assert losses(sharded) == pytest.approx(losses(single), abs=1e-5, rel=0)
    assert losses(single)[-1] < losses(single)[0]
    assert sorted(p.name for p in (sharded / "checkpoints" / "step-0000002").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one shard file per process

    killed.mkdir()
    process = subprocess.Popen(torchrun(killed, "--save-every", "2", "--step-sleep", "0.3"), env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            log = killed / "losses.jsonl"
            if log.exists() and len(log.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and both training processes
        process.wait(timeout=30)
    assert 5 <= len(losses(killed)) < STEPS
    run(torchrun(killed, "--save-every", "2", "--resume"), killed)
    assert losses(killed) == losses(sharded)  # bitwise: the same floats, step by step


def test_shipped_accelerate_configs_are_fsdp2():
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    from switchhead.training.accelerate_configs import CONFIGS, path

    state_dicts = set()
    for name in CONFIGS:
        config = yaml.safe_load(Path(path(name)).read_text())
        assert config["distributed_type"] == "FSDP"
        fsdp = config["fsdp_config"]
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # taken from the model's _no_split_modules
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type=fsdp["fsdp_state_dict_type"],
            reshard_after_forward=fsdp["fsdp_reshard_after_forward"])
        state_dicts.add(str(plugin.state_dict_type))
    assert len(state_dicts) == 2  # full and sharded
    with pytest.raises(ValueError, match="fsdp2"):
        path("nope")
