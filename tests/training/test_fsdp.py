"""FSDP2 training on CPU: 2 gloo processes (torchrun, `fully_shard` per decoder layer) against one process.

Accelerate (1.15) cannot run FSDP on CPU processes. `accelerate launch --config_file fsdp2.yaml` takes its
torchrun-based launcher, which leaves ACCELERATE_USE_CPU unset, and `PartialState._prepare_backend` picks a backend
only for an accelerator, so on a CPU machine each process runs alone ("process 0 of 1"); with ACCELERATE_USE_CPU=true
they join over gloo as `MULTI_CPU`, but `AcceleratorState.__init__` switches only accelerator process groups
(MULTI_GPU, MULTI_XPU, MULTI_NPU, ...) to FSDP, so `prepare` wraps the model in DDP. What runs is tested here:
`switchhead train --accelerate-config fsdp2 --num-processes 2` on CPU (2 gloo processes, DDP) gives the losses of
one process within 1e-5, and the same config launched without the CPU flag is refused instead of training twice
into one folder. The shipped configs are checked to parse into Accelerate's FSDP2 plugin with the model's wrap
classes. The FSDP2 training itself is tested with torch's `fully_shard` directly, the same wrapping Accelerate
applies (tests/training/fsdp_worker.py): same losses as one process on the same global batch within 1e-5 (fp32), and a run
killed with SIGKILL and resumed from its `torch.distributed.checkpoint` shards continues with bitwise-identical
losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.network import free_port

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
STEPS = 8
COMMON = ["--steps", str(STEPS), "--preset", "tiny-switchall", "--no-entropy-reg"]


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


@pytest.mark.integration
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


TRAIN = ["--preset", "tiny-switchhead", "--vocab-size", "512", "--block-size", "32", "--batch-size", "8",
         "--max-steps", "5", "--log-every", "1", "--eval-every", "5", "--eval-batches", "2", "--save-every", "5",
         "--no-progress", "--no-tensorboard"]


def corpus(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Paragraph {i}: the European lobster lives {i % 50} metres deep near rock {i % 7}.\n"
                            for i in range(5000)))
    return text


def train_env() -> dict:
    return {**env(), "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def log_losses(output: Path) -> list[float]:
    import csv

    with open(output / "log.csv", newline="") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


@pytest.mark.integration
def test_train_with_the_shipped_fsdp2_config_on_two_cpu_processes(tmp_path):
    """What Accelerate runs on CPU: `--accelerate-config fsdp2` starts 2 gloo processes (DDP; FSDP needs an
    accelerator), with the losses of one process on the same global batch."""
    data = str(corpus(tmp_path))
    train = [sys.executable, "-m", "switchhead.cli", "train", *TRAIN, "--data", data]
    single = subprocess.run([*train, "--output-dir", str(tmp_path / "single")], env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    launched = subprocess.run([*train, "--accelerate-config", "fsdp2", "--num-processes", "2", "--output-dir",
                               str(tmp_path / "two")], env=train_env(), capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "Accelerate applies FSDP on accelerators only" in launched.stderr
    state = json.loads((tmp_path / "two" / "checkpoints" / "step-0000005" / "trainer_state.json").read_text())
    assert state["num_processes"] == 2
    assert len(log_losses(tmp_path / "two")) == 5
    assert log_losses(tmp_path / "two") == pytest.approx(log_losses(tmp_path / "single"), abs=1e-5, rel=0)


@pytest.mark.integration
def test_fsdp2_config_launched_on_cpu_without_the_cpu_flag_is_refused(tmp_path):
    """`accelerate launch --config_file fsdp2.yaml` on a CPU machine starts 2 processes that Accelerate does not
    join: the trainer refuses (exit 2, one line) instead of letting both train into the same folder."""
    from switchhead.training.accelerate_configs import path

    environment = {key: value for key, value in train_env().items() if key != "ACCELERATE_USE_CPU"}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", path("fsdp2"),
                           "--main_process_port", str(free_port()), "-m", "switchhead.cli", "train", *TRAIN,
                           "--data", str(corpus(tmp_path)), "--output-dir", str(tmp_path / "run")],
                          env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "switchhead train: error: 2 processes were launched but Accelerate joined none of them" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--accelerate-config", "nope"], "--accelerate-config: no file 'nope' (or a shipped config: fsdp2, "
                                      "fsdp2_sharded)"),
    (["--num-processes", "2"], "--num-processes goes with --accelerate-config (or use `accelerate launch "
                               "--num_processes N -m switchhead.cli train ...`)"),
    (["--accelerate-config", "fsdp2", "--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    (["--accelerate-config", "fsdp2", "--demo"], "--demo runs in one process; drop --accelerate-config"),
])
@pytest.mark.integration
def test_accelerate_config_usage_errors(arguments, message):
    done = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", *arguments], env=train_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("switchhead train: error:")]
    assert lines == [f"switchhead train: error: {message}"], done.stderr[-2000:]

