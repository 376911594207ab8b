"""Fail loudly, lose nothing: the divergence guard, users' files, checkpoint manifests, RNG state on
resume, verified run folders, the run folder's tokenizer, and empty / out-of-vocabulary inputs.

Every run trains the tiny SwitchHead preset for a few steps on real text (WikiText-2's validation file from
../shared/data) with one BPE tokenizer trained once for the module, so each run takes seconds.
"""

import csv
import hashlib
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main
from switchhead.integrity import MANIFEST, verify_manifest
from switchhead.training import TrainingConfig, checkpoint_dirs, train
from switchhead.training.trainer import TrainingDiverged, TrainingError

from helpers.runs import corpus  # noqa: F401 - the module-scoped fixture: data, tokenizer

SETTINGS = dict(block_size=32, batch_size=8, max_steps=6, warmup_steps=0, log_every=1, eval_every=6,
                eval_batches=2, save_every=2, keep_checkpoints=3, progress=False, tensorboard=False)


def config_for(corpus, output: Path, **overrides) -> TrainingConfig:
    data, tokenizer = corpus
    return TrainingConfig.from_preset("tiny-switchhead", data=data, tokenizer=tokenizer, output_dir=str(output),
                                      **{**SETTINGS, **overrides})


def cli_args(corpus, output: Path, *extra: str) -> list[str]:
    data, tokenizer = corpus
    return ["train", "--data", data, "--tokenizer", tokenizer, "--output-dir", str(output), "--block-size", "32",
            "--batch-size", "8", "--max-steps", "6", "--warmup-steps", "0", "--log-every", "1", "--eval-every", "6",
            "--eval-batches", "2", "--save-every", "2", "--keep-checkpoints", "3", "--no-progress",
            "--no-tensorboard", *extra]


def error_line(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"switchhead {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def all_finite(path: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(path).values() if t.is_floating_point())


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4); tests work on copies of it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(config_for(corpus, run, max_steps=4))
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


@pytest.fixture
def nan_at(monkeypatch):
    """nan_at({3, 4}): the training forward of those optimizer steps (1-based) returns a NaN loss."""
    def install(steps: set[int]):
        original = SwitchHeadForCausalLM.forward
        calls = {"n": 0}

        def forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if self.training:
                calls["n"] += 1
                if calls["n"] in steps:
                    out.loss = out.loss * float("nan")
            return out

        monkeypatch.setattr(SwitchHeadForCausalLM, "forward", forward)
    return install


# ================================================================================================ 1: divergence
def test_a_diverging_run_stops_with_exit_3_naming_the_step_and_saves_nothing_non_finite(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_args(corpus, run, "--learning-rate", "1e6", "--max-steps", "30", "--save-every", "1")) == 3
    line = error_line(capsys)
    assert "non-finite" in line and "the update was not applied" in line and "step " in line
    assert not (run / "model.safetensors").exists()  # no final model
    checkpoints = checkpoint_dirs(str(run))
    assert line.split("last good checkpoint: ")[1].startswith(checkpoints[-1]) if checkpoints else True
    for folder in checkpoints:
        assert all_finite(Path(folder) / "model.safetensors"), folder
    rows = list(csv.DictReader(open(run / "log.csv")))
    assert not math.isfinite(float(rows[-1]["loss"]))  # the bad step is logged
    assert "stopped: step" in (run / "events.log").read_text()


def test_resume_from_the_last_good_checkpoint_after_a_stop_equals_an_uninterrupted_run(corpus, tmp_path, nan_at):
    reference = train(config_for(corpus, tmp_path / "reference"))
    nan_at({5})
    with pytest.raises(TrainingDiverged) as stopped:
        train(config_for(corpus, tmp_path / "run"))
    assert stopped.value.step == 5 and stopped.value.last_checkpoint.endswith("step-0000004")
    assert not (tmp_path / "run" / "model.safetensors").exists()
    nan_at(set())  # the fault is gone: resume
    resumed = train(config_for(corpus, tmp_path / "run", resume="latest"))
    assert resumed.step == 6 and resumed.valid_loss == reference.valid_loss
    want = load_file(tmp_path / "reference" / "model.safetensors")
    got = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_skip_nonfinite_skips_bad_updates_counts_them_in_the_log_and_stops_past_the_limit(corpus, tmp_path, nan_at):
    nan_at({3})
    result = train(config_for(corpus, tmp_path / "skip", skip_nonfinite=1))
    assert result.step == 6 and all_finite(tmp_path / "skip" / "model.safetensors")
    rows = list(csv.DictReader(open(tmp_path / "skip" / "log.csv")))
    assert [int(r["skipped_updates"]) for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[2]["loss"] == "nan"
    assert "skipped a non-finite update" in (tmp_path / "skip" / "events.log").read_text()

    nan_at({3, 4})  # two in a row with a limit of one: stop at the second
    with pytest.raises(TrainingDiverged) as stopped:
        train(config_for(corpus, tmp_path / "stop", skip_nonfinite=1))
    assert stopped.value.step == 4 and "2 bad updates in a row" in str(stopped.value)


# ================================================================================================ 2: users' files
def test_train_refuses_a_users_folder_a_file_and_its_own_run_without_resume_or_overwrite(corpus, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"mine": true}')
    (user / "log.csv").write_text("my,numbers\n1,2\n")
    before = digest(user)
    for extra in ([], ["--overwrite"]):
        assert main(cli_args(corpus, user, *extra)) == 2
        line = error_line(capsys)
        assert "is not empty and is not a switchhead training run" in line and str(user) in line
    assert digest(user) == before

    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me")
    assert main(cli_args(corpus, a_file)) == 2
    assert "is a file" in error_line(capsys) and a_file.read_text() == "keep me"

    run = tmp_path / "run"
    assert main(cli_args(corpus, run, "--max-steps", "2")) == 0
    capsys.readouterr()
    (run / "notes.txt").write_text("my notes")
    before = digest(run)
    assert main(cli_args(corpus, run, "--max-steps", "2")) == 2
    assert "pass --resume to continue it or --overwrite" in error_line(capsys)
    assert digest(run) == before
    assert main(cli_args(corpus, run, "--max-steps", "2", "--overwrite", "--seed", "1")) == 0
    assert (run / "notes.txt").read_text() == "my notes"  # only the run's own files were replaced
    assert not verify_manifest(str(run)) and [Path(p).name for p in checkpoint_dirs(str(run))] == ["step-0000002"]


def test_card_and_eval_output_never_replace_a_file_without_overwrite(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    readme = run / "README.md"
    readme.write_text("my own card")
    assert main(["card", str(run)]) == 2
    assert "already exists; pass --overwrite" in error_line(capsys, "card")
    assert readme.read_text() == "my own card"
    assert main(["card", str(run), "--overwrite"]) == 0 and "SwitchHead" in readme.read_text()
    results = tmp_path / "results.json"
    results.write_text("{}")
    assert main(["eval", str(run), "--tasks", "none", "--output", str(results)]) == 2
    assert "already exists" in error_line(capsys, "eval") and results.read_text() == "{}"


# ================================================================================================ 6: manifests
def test_checkpoints_and_the_run_folder_carry_verified_manifests(finished):
    run = finished
    for folder in checkpoint_dirs(str(run)) + [str(run)]:
        assert (Path(folder) / MANIFEST).is_file() and verify_manifest(folder) == [], folder
    listed = (run / "checkpoints" / "step-0000004" / MANIFEST).read_text()
    assert "model.safetensors" in listed and "optimizer.bin" in listed and "rng_state_0.safetensors" in listed and "random_states_0.pkl" not in listed


def test_resume_falls_back_past_a_changed_checkpoint_and_refuses_it_by_name(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    newest = Path(checkpoint_dirs(str(run))[-1])
    flip_byte(newest / "optimizer.bin")
    before = digest(run)
    assert main(["train", "--output-dir", str(run), "--resume", str(newest), "--no-progress"]) == 2
    assert "changed optimizer.bin" in error_line(capsys) and digest(run) == before

    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "damaged or incomplete (changed optimizer.bin)" in out and "falling back" in out and "step-0000002" in out
    assert "falling back to the newest intact checkpoint" in (run / "events.log").read_text()
    assert not verify_manifest(str(run))


def test_resume_refuses_an_optimizer_state_of_another_shape_in_one_line(finished, tmp_path, capsys):
    """A checkpoint whose manifest matches but whose AdamW moments do not have the parameters' shapes (written for
    another model, its manifest made again) stops the resume with one line, not a traceback at the first step."""
    from switchhead.integrity import write_manifest

    run = copy_of(finished, tmp_path)
    newest = Path(checkpoint_dirs(str(run))[-1])
    state = torch.load(newest / "optimizer.bin", map_location="cpu", weights_only=True)
    moments = state["state"][0]
    moments["exp_avg"] = moments["exp_avg"][:-1].clone()
    torch.save(state, newest / "optimizer.bin")
    write_manifest(str(newest))
    before = digest(run)
    assert main(["train", "--output-dir", str(run), "--resume", str(newest), "--no-progress"]) == 2
    line = error_line(capsys)
    assert "does not fit this run's model" in line and "'exp_avg' of parameter 0" in line
    assert digest(run) == before


def test_a_damaged_or_missing_rng_state_stops_resume_unless_inexact_resume(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    newest = Path(checkpoint_dirs(str(run))[-1])
    rng = newest / "rng_state_0.safetensors"
    rng.write_bytes(rng.read_bytes()[:40])  # truncated
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "6", "--no-progress"]) == 2
    line = error_line(capsys)
    assert "RNG state" in line and "--inexact-resume" in line and "rng_state_0.safetensors" in line
    rng.unlink()  # missing altogether: the same
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "6", "--no-progress"]) == 2
    assert "missing rng_state_0.safetensors" in error_line(capsys)
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "6", "--no-progress",
                 "--inexact-resume"]) == 0
    assert "inexact resume from" in (run / "events.log").read_text()


def test_eval_and_generate_refuse_a_changed_or_incomplete_run_folder(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    assert main(["generate", str(run), "--prompt", "The game", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    flip_byte(run / "model.safetensors")
    assert main(["generate", str(run), "--prompt", "The game"]) == 2
    assert "damaged or incomplete (changed model.safetensors)" in error_line(capsys, "generate")
    assert main(["eval", str(run), "--tasks", "none"]) == 2
    assert "changed model.safetensors" in error_line(capsys, "eval")
    assert main(["generate", str(run), "--prompt", "The game", "--max-new-tokens", "2", "--no-verify"]) == 0
    capsys.readouterr()
    (run / MANIFEST).unlink()  # a final save that never finished
    assert main(["generate", str(run), "--prompt", "The game"]) == 2
    assert "incomplete" in error_line(capsys, "generate")


# ================================================================================================ 8: tokenizer
def test_the_run_folders_tokenizer_loads_with_autotokenizer_without_a_prompt(corpus, finished, monkeypatch):
    import builtins

    from transformers import AutoTokenizer

    run = finished

    def no_prompt(*args):
        raise AssertionError(f"asked the user: {args}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    tokenizer = AutoTokenizer.from_pretrained(run)
    saved = AutoTokenizer.from_pretrained(corpus[1])
    text = " The game was released in Japan ."
    assert tokenizer(text)["input_ids"] == saved(text)["input_ids"] and len(tokenizer) == 512


# ================================================================================================ 5: inputs
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).eval()


@pytest.mark.parametrize("call", ["forward ids", "forward embeds", "generate ids", "no batch"])
def test_empty_input_is_a_value_error_that_says_so(tiny_model, call):
    with pytest.raises(ValueError, match="is empty"):
        if call == "forward ids":
            tiny_model(torch.zeros(1, 0, dtype=torch.long))
        elif call == "forward embeds":
            tiny_model(inputs_embeds=torch.zeros(1, 0, 64))
        elif call == "generate ids":
            tiny_model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, do_sample=False)
        else:
            tiny_model(torch.zeros(0, 4, dtype=torch.long))


@pytest.mark.parametrize("shape, hint", [((5,), "input_ids[None]"), ((1, 2, 5), ""), ((), "")])
def test_input_ids_of_the_wrong_rank_name_the_expected_layout(tiny_model, shape, hint):
    with pytest.raises(ValueError, match=r"input_ids must be shaped \[batch, length\], got shape") as error:
        tiny_model(torch.ones(shape, dtype=torch.long))
    assert hint in str(error.value)
    with pytest.raises(ValueError, match=r"inputs_embeds must be shaped \[batch, length, hidden_size\].*\[None\]"):
        tiny_model(inputs_embeds=torch.zeros(4, 64))


@pytest.mark.parametrize("bad", [512, 10_000, -1])
def test_out_of_vocabulary_ids_name_the_vocabulary_size_in_forward_and_generate(tiny_model, bad):
    ids = torch.tensor([[1, 2, bad]])
    with pytest.raises(ValueError, match=r"vocab_size=512"):
        tiny_model(ids)
    with pytest.raises(ValueError, match=r"vocab_size=512"):
        tiny_model.generate(ids, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # ids inside the vocabulary still work
        assert torch.isfinite(tiny_model(torch.tensor([[0, 511]])).logits).all()


def test_training_config_rejects_unknown_model_fields_with_a_suggestion(corpus, tmp_path):
    with pytest.raises(TrainingError, match="unknown field 'hiden_size'; did you mean hidden_size"):
        train(config_for(corpus, tmp_path / "run", model={"hiden_size": 32}))
    assert not (tmp_path / "run").exists()
