"""Must-show 5: `accelerate launch --multi_gpu --num_processes 2` with ACCELERATE_USE_CPU=true (2 gloo processes)
trains the tiny preset to the same losses as one process with the same global batch, and as one process that
accumulates the two halves of it.

(`accelerate launch --num_processes 2 --cpu` would start ONE process: Accelerate 1.x's CPU launcher is its simple
launcher, which runs the script once unless an MPI hostfile is given. The torchrun-based launcher with
ACCELERATE_USE_CPU=true forms the 2-process gloo group; the checkpoint's `num_processes` proves it.)"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.network import free_port

RUN = ["--preset", "tiny-switchhead", "--vocab-size", "512", "--block-size", "32", "--batch-size", "8",
       "--max-steps", "8", "--log-every", "1", "--eval-every", "4", "--eval-batches", "2", "--save-every", "8",
       "--no-progress", "--no-tensorboard"]


def losses(output: Path) -> tuple[list[float], list[float]]:
    with open(output / "log.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [float(r["loss"]) for r in rows], [float(r["valid_loss"]) for r in rows if r["valid_loss"]]


@pytest.mark.integration
def test_two_gloo_processes_reach_the_losses_of_one_process_with_the_same_global_batch(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Paragraph {i}: the European lobster lives {i % 50} metres deep near rock {i % 7}.\n"
                            for i in range(5000)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    train = ["-m", "switchhead.cli", "train", *RUN, "--data", str(text)]
    runs = {
        "single": [sys.executable, *train, "--output-dir", str(tmp_path / "single")],
        "accumulated": [sys.executable, *train, "--gradient-accumulation-steps", "2",
                        "--output-dir", str(tmp_path / "accumulated")],
        "two processes": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "--main_process_port", str(free_port()), *train, "--output-dir", str(tmp_path / "ddp")],
    }
    for name, cmd in runs.items():
        done = subprocess.run(cmd, env={**env, "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (name, done.stderr[-3000:])
    ddp_out = (tmp_path / "ddp" / "log.csv")
    assert ddp_out.exists()
    state = json.loads(next((tmp_path / "ddp" / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["num_processes"] == 2  # really two processes, not one

    single, single_valid = losses(tmp_path / "single")
    for name in ("accumulated", "ddp"):
        other, other_valid = losses(tmp_path / name)
        assert len(other) == len(single) == 8
        assert other == pytest.approx(single, rel=2e-5, abs=2e-5), name
        assert other_valid == pytest.approx(single_valid, rel=2e-5, abs=2e-5), name
    assert single[-1] < single[0]  # it did train
