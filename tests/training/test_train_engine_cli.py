"""`switchhead train` on Transformers' distributed engine: `torchrun --nproc_per_node 2 -m
switchhead.cli train --fsdp-size 2 --ep-size 2` (gloo, CPU) on tiny SwitchAll, against one process.

- The 4 logged losses and the validation loss equal one process that accumulates the two processes' shares of each
  step (relative 1e-5; measured ~1e-7: the sums are only reordered), and the final weights are those of one process
  within 1e-4 after 4 AdamW steps (measured 8e-6).
- Rank 0 alone writes the run folder: the files are those of a one-process run with one RNG state and XL memory per
  process; every checkpoint and the model folder verify against their SHA-256 manifests with no unlisted file; and
  an audit hook in each process (tests' sitecustomize: Python's file events, torch.save and safetensors' save_file)
  records every write into the folder: rank 1 has none, rank 0 has them all.
- Resumed under torchrun from the step-2 checkpoint, the run logs the uninterrupted run's losses and writes the same
  model file, byte for byte.
- Sizes that fit no launch (no launcher; tp x fsdp not the launched processes) and a layout the model refuses
  (expert parallelism without sigma-MoE experts) end with exit status 2 (torchrun: 1, its own report after ours) and
  exactly one line `switchhead train: error: ...` on stderr, from rank 0, before the run folder holds anything.
Skipped on Transformers releases without expert parallelism in their distributed engine (5.17 has a DistributedConfig
without ep_size).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.network import free_port

pytestmark = [pytest.mark.integration,  # launches and trains
              pytest.mark.skipif(importlib.util.find_spec("transformers.distributed.expert_parallel") is None,
                                 reason="this Transformers release has no expert parallelism in its distributed engine")]

NO_DROPOUT = [item for name in ("hidden_dropout", "attention_dropout", "mlp_expert_dropout", "attention_expert_dropout")
              for item in ("--set", f"{name}=0")]
RUN = ["--preset", "tiny-switchall", "--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--max-steps",
       "4", "--warmup-steps", "1", "--log-every", "1", "--eval-every", "4", "--eval-batches", "2", "--save-every", "2",
       "--keep-checkpoints", "2", "--no-progress", "--no-tensorboard", *NO_DROPOUT]
ENGINE = ["--fsdp-size", "2", "--ep-size", "2"]
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-4

# Loaded by every Python process whose path holds its folder: records the writes into WATCHED (a folder) to
# WRITES_LOG.<rank>.json at exit. Python's audit events cover open(), os.* and shutil; torch.save and safetensors'
# save_file write from C++ / Rust, so they are wrapped when their modules are imported.
SITECUSTOMIZE = r'''
import atexit, json, os, sys
WATCHED = os.path.realpath(os.environ["WATCHED"])
writes = []

def inside(path):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(WATCHED)
    except (TypeError, ValueError):
        return False

def note(kind, path):
    if inside(path):
        writes.append([kind, os.path.relpath(os.path.realpath(os.fsdecode(path)), WATCHED)])

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            note("open", path)
    elif event == "os.mkdir" and not os.path.exists(os.fsdecode(args[0])):
        note("mkdir", args[0])
    elif event in ("os.rename", "os.remove", "os.rmdir", "os.truncate", "os.symlink", "os.link", "shutil.rmtree",
                   "shutil.copyfile", "shutil.move"):
        note(event, args[1] if event in ("os.rename", "os.symlink", "os.link", "shutil.copyfile", "shutil.move")
             else args[0])

sys.addaudithook(hook)

class Wrapper:
    """After torch.serialization / safetensors.torch execute, wrap their file writers."""
    def find_spec(self, name, path=None, target=None):
        if name not in ("torch.serialization", "safetensors.torch"):
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        run = loader.exec_module
        def exec_module(module):
            run(module)
            attribute = "save" if name == "torch.serialization" else "save_file"
            real = getattr(module, attribute)
            def wrapped(obj, f, *args, **kwargs):
                if isinstance(f, (str, bytes, os.PathLike)):
                    note(attribute, f)
                return real(obj, f, *args, **kwargs)
            setattr(module, attribute, wrapped)
        loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Wrapper())

@atexit.register
def dump():
    with open(os.environ["WRITES_LOG"] + "." + os.environ.get("RANK", "x") + ".json", "w") as handle:
        json.dump(writes, handle)
'''


def _env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", **extra}


def _torchrun(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "switchhead.cli", "train", *args]
    return subprocess.run(command, env=env or _env(), capture_output=True, text=True, timeout=600)


def _log(folder: Path) -> list[dict]:
    with open(folder / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _files(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (2 accumulated micro-batches a step) and 2 processes under the engine, with the write audit."""
    root = tmp_path_factory.mktemp("engine")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"Paragraph {i}: the European lobster lives {i % 50} metres deep near rock {i % 7}.\n"
                              for i in range(3000)))
    common = [*RUN, "--data", str(corpus)]
    single = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", *common, "--gradient-accumulation-steps",
                             "2", "--output-dir", str(root / "single")], env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    audit = root / "audit"
    audit.mkdir()
    (audit / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(audit), os.environ.get("PYTHONPATH")]))
    engine = _torchrun(*common, *ENGINE, "--output-dir", str(root / "engine"),
                       env=_env(PYTHONPATH=path, WATCHED=str(root / "engine"), WRITES_LOG=str(audit / "writes")))
    assert engine.returncode == 0, engine.stderr[-3000:]
    return {"root": root, "single": root / "single", "engine": root / "engine", "corpus": corpus,
            "writes": {rank: json.loads((audit / f"writes.{rank}.json").read_text()) for rank in (0, 1)}}


def test_fsdp_and_expert_parallel_from_the_command_line_train_like_one_process(runs):
    import torch
    from safetensors.torch import load_file

    from switchhead import SwitchHeadForCausalLM

    single, engine = _log(runs["single"]), _log(runs["engine"])
    assert [row["step"] for row in engine] == [row["step"] for row in single] == ["1", "2", "3", "4"]
    for ours, reference in zip(engine, single):
        for column in ("loss", "valid_loss"):
            if reference[column]:
                assert float(ours[column]) == pytest.approx(float(reference[column]), rel=LOSS_TOLERANCE), (column, ours)
    assert float(single[-1]["loss"]) < float(single[0]["loss"]) - 0.5  # it trained
    state = json.loads(next((runs["engine"] / "checkpoints").glob("step-*/trainer_state.json")).read_text())
    assert state["num_processes"] == 2 and state["config"]["distributed"] == {"fsdp_size": 2, "ep_size": 2}
    weights, reference = load_file(runs["engine"] / "model.safetensors"), load_file(runs["single"] / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=WEIGHT_TOLERANCE, msg=name)
    # the run folder is an ordinary save_pretrained folder for one process
    model = SwitchHeadForCausalLM.from_pretrained(runs["engine"])
    assert model.config.num_mlp_experts == 8 and getattr(model.config, "distributed_config", None) is None


def test_rank_0_alone_writes_the_run_folder(runs):
    from switchhead.integrity import verify_manifest
    from switchhead.training.checkpoint_files import checkpoint_dirs, inspect_checkpoint

    single, engine = _files(runs["single"]), _files(runs["engine"])
    per_process = {name for name in engine if "rng_state_1" in name or "xl_memory_1" in name}
    assert per_process == {f"checkpoints/step-000000{s}/{kind}_1.safetensors" for s in (2, 4)
                           for kind in ("rng_state", "xl_memory")}
    assert engine - per_process == single
    for checkpoint in checkpoint_dirs(str(runs["engine"])):
        assert inspect_checkpoint(checkpoint) == ([], []), checkpoint  # manifest verifies, no unlisted file
    assert verify_manifest(str(runs["engine"])) == []
    writes = runs["writes"]
    assert writes[1] == [], writes[1][:10]
    # a file is written as .partial-NAME in a private folder of a random name beside NAME, then renamed by
    # descriptor (which the audit does not see as a path); a checkpoint is staged in .tmp-step-0000002-<hex>
    written = {re.sub(r"^(checkpoints/\.tmp-step-\d{7})-[0-9a-f]{16}/", r"\1/",
                      re.sub(r"^((?:[^/]+/)*)\.partial-[0-9a-f]{16}/\.partial-([^/]+)$", r"\1\2", path))
               for _, path in writes[0]}
    assert {"log.csv", "training_config.json", "checkpoints/.tmp-step-0000002/model.safetensors",
            "checkpoints/.tmp-step-0000002/optimizer.bin", "checkpoints/.tmp-step-0000002/rng_state_1.safetensors",
            "SHA256SUMS"} <= written, sorted(written)
    # the final model is written into a temporary folder of a fresh name, then renamed file by file
    assert any(path.startswith(".tmp-save-") and path.endswith("/model.safetensors") for path in written), \
        sorted(written)


@pytest.mark.integration
def test_a_resumed_run_continues_with_the_uninterrupted_losses(runs):
    resumed = runs["root"] / "resumed"
    shutil.copytree(runs["engine"], resumed)
    done = _torchrun("--output-dir", str(resumed), "--resume", str(resumed / "checkpoints" / "step-0000002"),
                     "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming at step 2" in done.stdout
    numbers = ("step", "loss", "learning_rate", "grad_norm", "valid_loss", "valid_perplexity", "skipped_updates")
    logged = [[row[name] for name in numbers] for row in _log(resumed)]
    assert logged == [[row[name] for name in numbers] for row in _log(runs["engine"])]  # steps 3, 4: to the last digit
    assert (resumed / "model.safetensors").read_bytes() == (runs["engine"] / "model.safetensors").read_bytes()


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "switchhead train: error:" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("switchhead train: error: "), lines[0]
    return lines[0]


@pytest.mark.integration
def test_sizes_that_fit_no_launch_or_model_exit_2_with_one_line(runs, tmp_path):
    common = [*RUN, "--data", str(runs["corpus"])]
    # no launcher: the whole of stderr is the one line
    alone = subprocess.run([sys.executable, "-m", "switchhead.cli", "train", *common, *ENGINE, "--output-dir",
                            str(tmp_path / "alone")], env=_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
    assert "start them with `torchrun --nproc_per_node 2" in _one_error_line(alone.stderr)
    assert not (tmp_path / "alone").exists()

    # tp x fsdp is 4, torchrun started 2: torchrun exits 1 after rank 0's line and its own report
    mismatch = _torchrun(*common, "--tp-size", "2", "--fsdp-size", "2", "--output-dir", str(tmp_path / "mismatch"))
    assert mismatch.returncode == 1
    assert "must equal the 2 launched processes, got 2 x 2 = 4" in _one_error_line(mismatch.stderr)
    assert not (tmp_path / "mismatch").exists()

    # expert parallelism for a model whose feed-forward has no experts: refused before the run folder holds anything
    dense = _torchrun(*common[2:], "--preset", "tiny-switchhead", *ENGINE, "--output-dir", str(tmp_path / "dense"))
    assert dense.returncode == 1
    assert "expert parallelism shards the sigma-MoE feed-forward experts" in _one_error_line(dense.stderr)
    assert not (tmp_path / "dense").exists()
