"""`--report-to` on `switchhead train` (Accelerate's trackers) and `switchhead finetune` (Trainer's report_to):
TensorBoard gets the logged scalars and a resume continues its curve, any tracker gets every log.csv row, a tracker
that is not installed is one note line and the run goes on."""

import csv
import json
import os

import pytest
import torch

from switchhead.cli import main
from switchhead.training.run_config import TrainingConfig, TrainingError, report_trackers


def train_args(corpus, output, steps, *extra):
    return ["train", "--data", str(corpus), "--output-dir", str(output), "--vocab-size", "320", "--block-size", "32",
            "--batch-size", "4", "--max-steps", str(steps), "--log-every", "1", "--eval-every", "2",
            "--eval-batches", "1", "--save-every", "2", "--keep-checkpoints", "3", "--no-progress", *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(f"Line {i} of a small corpus about lobsters, kelp and tides.\n" for i in range(1500)))
    return path


def log_rows(run) -> list[dict]:
    with open(run / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def row_metrics(row: dict) -> dict[str, float]:
    """A log.csv row as the trackers get it."""
    return {(f"valid/{key}" if "valid" in key else f"train/{key}"): float(value)
            for key, value in row.items() if key != "step" and value != ""}


def missing_tracker(known, installed) -> str:
    """A tracker the run can name whose package is not installed here (W&B or MLflow where they are absent)."""
    absent = [name for name in ("wandb", "mlflow", *sorted(known)) if name in known and name not in installed]
    assert absent, "every tracker is installed: nothing to test the note with"
    return absent[0]


# ================================================================================================ the names
def test_report_to_names_resolve_like_transformers():
    assert report_trackers(TrainingConfig()) == []  # default "none", as TrainingArguments.report_to
    assert report_trackers(TrainingConfig(report_to="tensorboard, wandb,tensorboard")) == ["tensorboard", "wandb"]
    assert report_trackers(TrainingConfig(report_to=["mlflow"])) == ["mlflow"]
    # the deprecated flag: False (--no-tensorboard) leaves TensorBoard out; True (a run stored by an older
    # version, which wrote TensorBoard by default) keeps it on a resume
    assert report_trackers(TrainingConfig(report_to="tensorboard,wandb", tensorboard=False)) == ["wandb"]
    assert report_trackers(TrainingConfig(tensorboard=True)) == ["tensorboard"]
    from accelerate.tracking import get_available_trackers

    assert report_trackers(TrainingConfig(report_to="all")) == [t.value for t in get_available_trackers()]
    for bad, words in (("tensorbord", "unknown tracker 'tensorbord'"), ("", "empty"), ("all,wandb", "stand alone"),
                       (3, "must be a tracker name")):
        with pytest.raises(TrainingError, match=words):
            report_trackers(TrainingConfig(report_to=bad))


def test_train_refuses_an_unknown_tracker_and_a_contradiction_in_one_line(tmp_path, capsys):
    for extra, words in ((["--report-to", "tensorbord"], "unknown tracker 'tensorbord'"),
                         (["--report-to", "wandb,tensorboard", "--no-tensorboard"], "contradicts")):
        assert main(train_args(tmp_path / "text.txt", tmp_path / "run", 2, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("switchhead train: error:") and words in err[0], err
    assert not (tmp_path / "run").exists()


# ================================================================================================ train
@pytest.mark.integration
def test_tensorboard_gets_every_logged_scalar_and_a_resume_continues_the_same_curve(corpus, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(train_args(corpus, run, 4, "--report-to", "tensorboard")) == 0
    # the run is resumed from its step-2 checkpoint (its stored --report-to holds): steps 3 and 4 are computed
    # again, and TensorBoard must show each step once, with the new values
    assert main(train_args(corpus, run, 4, "--resume", str(run / "checkpoints" / "step-0000002"))) == 0
    capsys.readouterr()
    folder = run / "tensorboard" / "switchhead"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    rows = log_rows(run)
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for tag, value in row_metrics(row).items():
            expected.setdefault(tag, []).append((int(row["step"]), value))
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "valid/valid_loss"} <= set(expected)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [step for step, _ in logged] == [step for step, _ in points], tag  # no step twice
        torch.testing.assert_close([value for _, value in logged], [value for _, value in points], rtol=1e-6,
                                   atol=0, msg=tag)


class _Recording:
    """What the registered fake tracker received, in order."""
    calls: list = []


@pytest.fixture
def recording_tracker():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, register_tracker_class

    class RecordingTracker(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self, run_name, **kwargs):
            super().__init__()
            _Recording.calls.append(("init", run_name, kwargs))

        @property
        def tracker(self):
            return None

        def store_init_configuration(self, values):
            _Recording.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            _Recording.calls.append(("log", step, dict(values)))

        def finish(self):
            _Recording.calls.append(("finish",))

    _Recording.calls = []
    register_tracker_class(RecordingTracker)
    yield _Recording.calls
    LOGGER_TYPE_TO_CLASS.pop("recording", None)


@pytest.mark.integration
def test_a_registered_tracker_gets_the_settings_and_every_logged_row(corpus, tmp_path, capsys, recording_tracker):
    run = tmp_path / "run"
    assert main(train_args(corpus, run, 4, "--report-to", "recording")) == 0
    assert capsys.readouterr().err == ""
    calls = recording_tracker
    assert [call[0] for call in calls] == ["init", "config", "log", "log", "log", "log", "finish"]
    assert calls[0][1] == "switchhead"
    settings = calls[1][1]
    assert json.loads(json.dumps(settings)) == settings  # JSON-safe, and flat: scalars only
    assert all(isinstance(value, (bool, int, float, str)) for value in settings.values())
    assert settings["max_steps"] == 4 and settings["report_to"] == "recording" and settings["adam_betas"] == "0.9,0.999"
    assert [(step, values) for _, step, values in calls[2:6]] == [(int(row["step"]), row_metrics(row))
                                                                   for row in log_rows(run)]
    assert not (run / "tensorboard").exists()


@pytest.mark.integration
def test_a_tracker_that_is_not_installed_is_one_note_and_the_run_goes_on(corpus, tmp_path, capsys):
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    name = missing_tracker({t.value for t in LoggerType} - {"all"}, {t.value for t in get_available_trackers()})
    run = tmp_path / "run"
    assert main(train_args(corpus, run, 2, "--report-to", name)) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"switchhead train: note: {name} not installed (pip install {name}); "
                                        "training without it"]
    assert "saved to" in out and len(log_rows(run)) == 2 and (run / "model.safetensors").exists()


# ================================================================================================ finetune
@pytest.fixture
def model_folder(tmp_path, corpus):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.training.data import train_tokenizer

    folder = tmp_path / "model"
    tokenizer = train_tokenizer([corpus.read_text()], 320)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer))) \
        .save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class _Built(Exception):
    """Raised by the stand-in Trainer once it has the TrainingArguments: nothing is trained."""


def built_arguments(monkeypatch, model_folder, corpus, output, **options):
    import transformers

    seen = {}

    class Trainer:
        def __init__(self, model=None, args=None, **kwargs):
            seen.update(args=args, tensorboard_dir=os.environ.get("TENSORBOARD_LOGGING_DIR"))
            raise _Built

    from switchhead.training.finetune import finetune

    monkeypatch.setattr(transformers, "Trainer", Trainer)
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    with pytest.raises(_Built):
        finetune(str(model_folder), str(corpus), str(output), r=2, max_steps=2, batch_size=2, block_size=16,
                 **options)
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ  # set only while Trainer builds its callbacks
    return seen


def test_finetune_passes_report_to_and_shows_the_progress_bar(monkeypatch, model_folder, corpus, tmp_path, capsys):
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    seen = built_arguments(monkeypatch, model_folder, corpus, tmp_path / "default")
    assert seen["args"].report_to == [] and seen["args"].disable_tqdm is False and seen["tensorboard_dir"] is None

    seen = built_arguments(monkeypatch, model_folder, corpus, tmp_path / "tb", report_to="tensorboard",
                           progress=False)
    assert seen["args"].report_to == ["tensorboard"] and seen["args"].disable_tqdm is True
    assert seen["tensorboard_dir"] == str(tmp_path / "tb" / "tensorboard")

    name = missing_tracker(set(INTEGRATION_TO_CALLBACK), set(get_available_reporting_integrations()))
    capsys.readouterr()
    seen = built_arguments(monkeypatch, model_folder, corpus, tmp_path / "missing", report_to=f"tensorboard,{name}")
    assert seen["args"].report_to == ["tensorboard"]
    assert capsys.readouterr().err.strip().splitlines() == [
        f"switchhead finetune: note: {name} not installed (pip install {name}); fine-tuning without it"]


def test_finetune_refuses_an_unknown_integration_in_one_line(model_folder, corpus, tmp_path, capsys):
    assert main(["finetune", str(model_folder), "--data", str(corpus), "--output-dir", str(tmp_path / "out"),
                 "--report-to", "tensorbord"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown integration 'tensorbord'" in err[0], err
    assert not (tmp_path / "out").exists()
