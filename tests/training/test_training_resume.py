"""Must-show 2: a training process killed with SIGKILL and resumed logs exactly the losses of an uninterrupted run,
and no checkpoint is ever left half-written. Uses an XL model with memory and gradient accumulation, so the data
position, the RNG states (dropout and expert dropout are on), the optimizer and the per-slot XL memory all have to
survive the kill."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchhead.training.checkpoint_files import read_memory, read_rng_state

RUN = ["--preset", "tiny-switchhead-xl", "--set", "xl_memory_length=32", "--set", "hidden_dropout=0.1",
       "--set", "attention_expert_dropout=0.1", "--vocab-size", "512", "--block-size", "32",
       "--batch-size", "8", "--gradient-accumulation-steps", "2", "--max-steps", "30", "--log-every", "1",
       "--eval-every", "10", "--eval-batches", "3", "--save-every", "4", "--keep-checkpoints", "3", "--no-progress",
       "--no-tensorboard"]


def command(data: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "switchhead.cli", "train", *RUN, "--data", str(data), "--output-dir", str(output),
            *extra]


def read_log(output: Path) -> list[dict]:
    with open(output / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def logged_steps(output: Path) -> int:
    try:
        return len((output / "log.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def assert_complete_checkpoints(output: Path) -> list[str]:
    """Every folder under a step-* name is whole: its state file, weights, optimizer and XL memory all load."""
    names = sorted(p.name for p in (output / "checkpoints").iterdir() if p.name.startswith("step-"))
    for name in names:
        folder = output / "checkpoints" / name
        state = json.loads((folder / "trainer_state.json").read_text())
        assert f"step-{state['step']:07d}" == name
        assert load_file(folder / "model.safetensors")
        assert torch.load(folder / "optimizer.bin", weights_only=True)["state"]
        memory = read_memory(str(folder), 0, "cpu")  # safetensors + JSON layout, no pickle
        assert len(memory) == 2 and all(m is None or len(m) == 2 for m in memory)
        assert read_rng_state(str(folder), 0)["torch_cpu"].dtype == torch.uint8
        assert not (folder / "random_states_0.pkl").exists() and not (folder / "xl_memory_0.pt").exists()
    return names


@pytest.mark.integration
def test_sigkill_then_resume_logs_exactly_the_losses_of_an_uninterrupted_run(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Sentence {i}: the lobster number {i % 97} swims {i % 13} metres towards the coast.\n"
                            for i in range(6000)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    reference = tmp_path / "reference"
    done = subprocess.run(command(text, reference), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    # kill the second run mid-way; prefer the moment a checkpoint is being written
    killed = tmp_path / "killed"
    process = subprocess.Popen(command(text, killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = killed / "checkpoints"
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline:
        writing = checkpoints.is_dir() and any(p.name.startswith(".tmp-step-0000012") for p in checkpoints.iterdir())
        if writing or logged_steps(killed) >= 17:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert 0 < logged_steps(killed) < 30
    before_resume = assert_complete_checkpoints(killed)
    assert before_resume, "no checkpoint was written before the kill"

    resumed = subprocess.run(command(text, killed, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step" in resumed.stdout + resumed.stderr

    expected, got = read_log(reference), read_log(killed)
    assert [row["step"] for row in got] == [str(step) for step in range(1, 31)]
    for want, have in zip(expected, got):
        assert float(have["loss"]) == float(want["loss"]), (want["step"], want["loss"], have["loss"])
        assert have["valid_loss"] == want["valid_loss"]
    assert_complete_checkpoints(killed)
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp")]  # leftovers cleaned on the next save
    final = load_file(killed / "model.safetensors")
    for name, tensor in load_file(reference / "model.safetensors").items():
        assert torch.equal(final[name], tensor), name
