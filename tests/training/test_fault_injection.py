"""Fault injection: `switchhead train` is killed with SIGKILL at random moments, some of them while a checkpoint
is being written, and restarted each time (`--resume` when a checkpoint exists, `--overwrite` when the kill came
before the first one). The final weights must equal an uninterrupted run's bitwise, and the log its losses.

The default suite injects a few kills; `pytest -m slow tests/training/test_fault_injection.py -s` injects at least 20 and
prints the tally quoted in docs/reliability.md. Data: WikiText-2's validation text from
../shared/data, with a tokenizer trained on it once per module.
"""

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchhead.integrity import verify_manifest
from switchhead.training import checkpoint_dirs

from helpers.runs import corpus  # noqa: F401 - the module-scoped fixture: data, tokenizer

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def command(corpus, output: Path, steps: int, *extra: str) -> list[str]:
    data, tokenizer = corpus
    return [sys.executable, "-m", "switchhead.cli", "train", "--preset", "tiny-switchhead-xl",
            "--set", "xl_memory_length=16", "--set", "hidden_dropout=0.1", "--set", "attention_expert_dropout=0.1",
            "--data", data, "--tokenizer", tokenizer, "--output-dir", str(output), "--block-size", "16",
            "--batch-size", "4", "--gradient-accumulation-steps", "2", "--max-steps", str(steps),
            "--warmup-steps", "2", "--log-every", "1", "--eval-every", "6", "--eval-batches", "2", "--save-every",
            "2", "--keep-checkpoints", "2", "--no-progress", "--no-tensorboard", *extra]


def restart_flags(run: Path) -> list[str]:
    if checkpoint_dirs(str(run)):
        return ["--resume"]
    if (run / "training_config.json").is_file():
        return ["--overwrite"]  # killed before the first checkpoint: start the run over
    return []


def checkpoint_writes(run: Path) -> set[str]:
    try:
        return {name for name in os.listdir(run / "checkpoints") if name.startswith(".tmp-step-")}
    except OSError:
        return set()


def kill_and_restart(corpus, run: Path, steps: int, kills: int, seed: int, full_run_seconds: float) -> dict:
    """Run to the end, killing the process `kills` times: alternately while its second checkpoint of this attempt
    is being written (so each attempt also makes progress) and after a random delay. The delay is drawn as a
    fraction of an uninterrupted run's wall time (`full_run_seconds`), so the kill lands inside the run on a fast
    machine as on a loaded one. Returns the tally."""
    rng = random.Random(seed)
    tally = {"kills": 0, "during_checkpoint_write": 0, "at_random_moment": 0, "resumed": 0, "started_over": 0}
    while tally["kills"] < kills:
        flags = restart_flags(run)
        if flags:
            tally["resumed" if flags == ["--resume"] else "started_over"] += 1
        process = subprocess.Popen(command(corpus, run, steps, *flags), env=ENV, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
        during_write = tally["kills"] % 2 == 0
        deadline = time.time() + (600 if during_write else rng.uniform(0.1, 0.45) * full_run_seconds)
        seen: set[str] = set()
        hit = False
        while process.poll() is None and time.time() < deadline:
            if during_write:
                seen |= checkpoint_writes(run)
                if len(seen) >= 2:
                    hit = True
                    break
            time.sleep(0.001)
        if process.poll() is not None:  # the run finished before this kill: no more moments to kill it at
            assert process.returncode == 0, process.stderr.read().decode()[-3000:]
            break
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        process.stderr.close()
        tally["kills"] += 1
        tally["during_checkpoint_write" if hit else "at_random_moment"] += 1
        for folder in checkpoint_dirs(str(run)):  # whatever the kill hit, every listed checkpoint is whole
            assert verify_manifest(folder) == [], folder
    final = subprocess.run(command(corpus, run, steps, *restart_flags(run)), env=ENV, capture_output=True,
                           text=True, timeout=900)
    assert final.returncode == 0, final.stderr[-3000:]
    return tally


def losses(run: Path) -> list[tuple[str, str]]:
    with open(run / "log.csv", newline="") as handle:
        return [(row["step"], row["loss"]) for row in csv.DictReader(handle)]


def assert_same_run(reference: Path, run: Path) -> None:
    assert losses(run) == losses(reference)
    want, got = load_file(reference / "model.safetensors"), load_file(run / "model.safetensors")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert verify_manifest(str(run)) == []


def reference_run(corpus, folder: Path, steps: int) -> tuple[Path, float]:
    """The uninterrupted run, and its wall time in seconds (process start included)."""
    run = folder / "run"
    started = time.monotonic()
    done = subprocess.run(command(corpus, run, steps), env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, time.monotonic() - started


@pytest.mark.integration
def test_a_few_sigkills_including_during_checkpoint_writes_end_bitwise_equal(corpus, tmp_path):
    reference, seconds = reference_run(corpus, tmp_path / "reference", steps=10)
    tally = kill_and_restart(corpus, tmp_path / "run", steps=10, kills=3, seed=0, full_run_seconds=seconds)
    print(f"fault injection: {tally}")
    assert tally["kills"] == 3 and tally["during_checkpoint_write"] >= 2
    assert_same_run(reference, tmp_path / "run")


@pytest.mark.slow
def test_twenty_sigkills_at_random_moments_end_bitwise_equal(corpus, tmp_path):
    reference, seconds = reference_run(corpus, tmp_path / "reference", steps=64)
    tally = kill_and_restart(corpus, tmp_path / "run", steps=64, kills=20, seed=1, full_run_seconds=seconds)
    print(f"fault injection: {tally}")
    assert tally["kills"] >= 20 and tally["during_checkpoint_write"] >= 10
    assert_same_run(reference, tmp_path / "run")
