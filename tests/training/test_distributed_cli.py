"""`switchhead train` under torchrun with Transformers' distributed engine for the plans the README shows (gloo,
CPU), and a launched process whose peers never start.

- `--fsdp-size 2` on tiny SwitchHead and tiny MoEUT (shared blocks, each run once per application) logs the losses
  of one process that accumulates the two processes' shares of each step, and saves each block once (the gradient
  norm and the loss of a sharded model are DTensors: the divergence guard must make them whole before it reduces
  them across processes, else every rank crashed at the first step).
- `--fsdp-size 2` on tiny SwitchAll and `--tp-size 2` on tiny SwitchHead-XL train to the end and save a folder that
  loads in one process.
- `WORLD_SIZE=2` with one process started (as rank 0, or as rank 1) stops within SWITCHHEAD_JOIN_TIMEOUT with one
  line `switchhead train: error: ...` and exit status 2, writing nothing, instead of waiting 30 minutes.
- On `--resume` only the main launched process probes the run folder's lock: a held lock stops rank 0 (and a
  process outside a launcher) with one line naming the holder, never rank 1, which would otherwise find the lock
  held by its own peer's probe.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.network import free_port

pytestmark = pytest.mark.integration

NO_DROPOUT = [item for name in ("hidden_dropout", "attention_dropout", "mlp_expert_dropout", "attention_expert_dropout")
              for item in ("--set", f"{name}=0")]
RUN = ["--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--max-steps", "2", "--warmup-steps", "1",
       "--log-every", "1", "--eval-every", "2", "--eval-batches", "2", "--save-every", "2", "--no-progress",
       "--no-tensorboard", *NO_DROPOUT]
CASE_TIMEOUT = 300  # seconds, each torchrun (two tiny runs on two CPU cores take about 30 s)


def _env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", **extra}


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "switchhead.cli", "train", *args]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=CASE_TIMEOUT)


def _log(folder: Path) -> list[dict]:
    with open(folder / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"Paragraph {i}: the European lobster lives {i % 50} metres deep near rock {i % 7}.\n"
                            for i in range(3000)))
    return path


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-moeut"])  # MoEUT: shared blocks, run once per application
def test_fsdp_trains_like_one_process(corpus, tmp_path, preset):
    common = ["--preset", preset, *RUN, "--data", str(corpus)]
    single = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", *common, "--gradient-accumulation-steps",
                             "2", "--output-dir", str(tmp_path / "single")], env=_env(), capture_output=True,
                            text=True, timeout=CASE_TIMEOUT)
    assert single.returncode == 0, single.stderr[-3000:]
    sharded = _torchrun(*common, "--fsdp-size", "2", "--output-dir", str(tmp_path / "fsdp"))
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "NotImplementedError" not in sharded.stderr
    ours, reference = _log(tmp_path / "fsdp"), _log(tmp_path / "single")
    assert [row["step"] for row in ours] == [row["step"] for row in reference] == ["1", "2"]
    for mine, theirs in zip(ours, reference):
        for column in ("loss", "grad_norm", "valid_loss"):
            if theirs[column]:
                assert float(mine[column]) == pytest.approx(float(theirs[column]), rel=1e-5), (column, mine, theirs)
    from safetensors import safe_open

    from switchhead import SwitchHeadConfig

    with safe_open(tmp_path / "fsdp" / "model.safetensors", "pt") as saved:  # each block once, shared or not
        blocks = {int(name.split(".")[2]) for name in saved.keys() if name.startswith("model.layers.")}
    assert blocks == set(range(SwitchHeadConfig.from_pretrained(tmp_path / "fsdp").num_distinct_layers))


@pytest.mark.parametrize("preset, plan", [("tiny-switchall", ["--fsdp-size", "2"]),
                                          ("tiny-switchhead-xl", ["--tp-size", "2"])])
def test_other_presets_and_plans_train_and_save_a_loadable_folder(corpus, tmp_path, preset, plan):
    from switchhead import SwitchHeadForCausalLM

    done = _torchrun("--preset", preset, *RUN, "--data", str(corpus), *plan, "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in _log(tmp_path / "run")] == ["1", "2"]
    assert all(float(row["loss"]) == float(row["loss"]) for row in _log(tmp_path / "run"))  # finite, logged
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "run")
    assert getattr(model.config, "distributed_config", None) is None


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_process_whose_peers_never_start_stops_within_the_join_timeout(corpus, tmp_path, rank):
    env = _env(WORLD_SIZE="2", RANK=rank, LOCAL_RANK=rank, LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), SWITCHHEAD_JOIN_TIMEOUT="3")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", "--preset", "tiny-switchhead", *RUN,
                           "--data", str(corpus), "--fsdp-size", "2", "--output-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("switchhead train: error: "), done.stderr[-3000:]
    assert "did not join within 3 s" in done.stderr and "SWITCHHEAD_JOIN_TIMEOUT" in done.stderr
    assert elapsed < 100  # interpreter start and imports included; torch's default wait is 30 minutes
    assert not (tmp_path / "run").exists()


def test_only_the_main_process_probes_the_lock_of_a_run_it_resumes(corpus, tmp_path):
    """The resume probe takes the folder's lock for a moment. Were every launched process to probe, one could find
    the lock held by its own peer and stop the launch; with the lock held here, rank 1 goes on to the join (and
    stops there, its peer never starting) while rank 0, and a process outside any launcher, report the holder."""
    from switchhead.integrity import FolderLock

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", "--preset", "tiny-switchhead", *RUN,
                           "--data", str(corpus), "--output-dir", str(run)], env=_env(), capture_output=True,
                          text=True, timeout=CASE_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    resume = [sys.executable, "-m", "switchhead.cli", "train", "--resume", "latest", "--output-dir", str(run),
              "--no-progress"]
    launched = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", SWITCHHEAD_JOIN_TIMEOUT="3")
    before = sorted(path.name for path in run.rglob("*"))
    with FolderLock(str(run), "test"):
        outcome = {}
        for rank in ("1", "0", None):
            env = _env(**launched, RANK=rank, LOCAL_RANK=rank, MASTER_PORT=str(free_port())) if rank else _env()
            outcome[rank] = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=120)
    for rank, result in outcome.items():
        assert result.returncode == 2 and result.stderr.count("\n") == 1, (rank, result.stderr[-3000:])
        assert result.stderr.startswith("switchhead train: error: "), (rank, result.stderr)
    assert "did not join within 3 s" in outcome["1"].stderr and "being written" not in outcome["1"].stderr
    for rank in ("0", None):
        assert "--output-dir:" in outcome[rank].stderr and "is being written by process" in outcome[rank].stderr
    assert sorted(path.name for path in run.rglob("*")) == before  # nothing written, nothing removed


def test_a_bad_join_timeout_is_refused_in_one_line(corpus, tmp_path):
    env = _env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               SWITCHHEAD_JOIN_TIMEOUT="nan")
    done = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", "--preset", "tiny-switchhead", *RUN,
                           "--data", str(corpus), "--fsdp-size", "2", "--output-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert "SWITCHHEAD_JOIN_TIMEOUT must be a number of seconds" in done.stderr
