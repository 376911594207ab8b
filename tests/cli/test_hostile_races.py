"""Links swapped in while a command runs: nothing is written through a link or uploaded from one, in any order of
events.

The attacker is anyone who can write into the output folder while the command runs. At the moment the command's
bytes are written (a library's write call, wrapped here), everything that appeared in the output folder since the
command began (a temporary file, a staging folder) is renamed away and a link to the user's own file (for a file)
or folder (for a folder) is put at its name; `files.race_hook` does the same at the writer's other steps (just
before a rename into place). What is asserted: the user's file and folder keep their bytes and their entries, and
the command either succeeds writing only where it should or fails with one line (exit code 2).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from switchhead.cli import main
from switchhead.integrity import LOCK_NAME, OutputError, Terminated, WriteError
from switchhead.integrity import files
from switchhead.integrity.files import atomic_file

from test_hostile_outputs import MINE, leftovers, model_dir, one_error_line, plotted  # noqa: F401 - fixtures

SECRET = b"the user's secret\n"


class Victim:
    """The user's own file and folder, outside the output folder."""

    def __init__(self, tmp_path: Path):
        self.folder = tmp_path / "users"
        self.folder.mkdir()
        self.file = self.folder / "mine.txt"
        self.file.write_text(MINE)
        self.entries = sorted(os.listdir(self.folder))

    def untouched(self) -> None:
        assert sorted(os.listdir(self.folder)) == self.entries, os.listdir(self.folder)
        assert self.file.read_text() == MINE


class Attacker:
    """Renames away each hidden temporary file or folder that appeared in `folder` since it was made, and links the
    user's file or folder at its name."""

    def __init__(self, folder: Path, victim: Victim):
        self.folder, self.victim = folder, victim
        self.before = set(os.listdir(folder))
        self.struck: list[str] = []

    def strike(self, *_) -> None:
        for name in sorted(set(os.listdir(self.folder)) - self.before):
            path = self.folder / name
            # a command's hidden temporaries and staging folders; not its lock, not the outputs it finished
            if path.is_symlink() or not name.startswith(".") or name.endswith(LOCK_NAME):
                continue
            aside = self.folder / f"moved{len(self.struck)}"
            os.rename(path, aside)
            self.before.add(aside.name)
            path.symlink_to(self.victim.folder if aside.is_dir() else self.victim.file)
            self.before.add(name)
            self.struck.append(name)


def outcome(code: int, capsys, command: str) -> None:
    """The command succeeded, or failed in one line with exit code 2."""
    if code != 0:
        assert code == 2
        one_error_line(capsys, command)


# ================================================================================================ the writer
def test_a_temporary_swapped_for_a_link_at_the_moment_of_the_write_receives_nothing(tmp_path):
    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    attacker = Attacker(out, victim)
    with atomic_file(str(out / "result.txt")) as temporary:
        attacker.strike()
        Path(temporary).write_text("new\n")
    assert attacker.struck
    victim.untouched()
    assert (out / "result.txt").read_text() == "new\n" and not (out / "result.txt").is_symlink()


@pytest.mark.parametrize("step", ["staged", "written", "publish"])
def test_a_private_folder_swapped_at_any_step_redirects_nothing(tmp_path, monkeypatch, step):
    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    attacker = Attacker(out, victim)
    monkeypatch.setattr(files, "race_hook", lambda at, name: attacker.strike() if at == step else None)
    try:
        files.write_bytes(str(out / "result.txt"), "new\n")
    except OutputError as error:  # the only other outcome: refused, in one line
        assert "was replaced while it was written" in str(error)
        assert not (out / "result.txt").exists()
    else:
        assert (out / "result.txt").read_text() == "new\n"
    assert attacker.struck
    victim.untouched()


def test_write_bytes_writes_through_its_descriptor_and_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    target.chmod(0o640)
    files.write_bytes(str(target), b"{}")
    assert target.read_bytes() == b"{}" and stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert os.listdir(tmp_path) == ["out.json"]
    with pytest.raises(OutputError, match="already exists"):
        files.write_bytes(str(target), b"x", overwrite=False)


def test_a_link_put_at_the_destination_just_before_the_rename_is_replaced_not_followed(tmp_path, monkeypatch):
    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()

    def plant(at, name):
        if at == "publish":
            (out / "result.txt").symlink_to(victim.file)

    monkeypatch.setattr(files, "race_hook", plant)
    files.write_bytes(str(out / "result.txt"), "new\n")
    victim.untouched()
    assert not (out / "result.txt").is_symlink() and (out / "result.txt").read_text() == "new\n"


def test_a_signal_at_the_moment_a_temporary_is_created_leaves_nothing_behind(tmp_path, monkeypatch):
    """SIGTERM raises Terminated where the command line receives it: here just after the temporary file or the
    private folder came into existence."""
    real_open, real_mkdir = os.open, os.mkdir

    def signalled_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT:
            os.close(fd)
            raise Terminated()
        return fd

    def signalled_mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        raise Terminated()

    for name, patched in (("open", signalled_open), ("mkdir", signalled_mkdir)):
        with monkeypatch.context() as patch:
            patch.setattr(os, name, patched)
            with pytest.raises(Terminated):
                with atomic_file(str(tmp_path / "plot.png")) as temporary:
                    Path(temporary).write_bytes(b"png")
        assert os.listdir(tmp_path) == [], name


def test_a_rename_onto_a_bind_mounted_file_is_one_line(tmp_path, monkeypatch, capsys):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    model = tmp_path / "model"

    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64)).save_pretrained(model)
    capsys.readouterr()
    card = tmp_path / "card.md"
    card.write_text(MINE)

    def busy(source, destination, **kwargs):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), source)

    monkeypatch.setattr(os, "rename", busy)
    monkeypatch.setattr(os, "replace", busy)
    assert main(["card", str(model), "--output", str(card), "--overwrite"]) == 2
    assert "cannot replace" in one_error_line(capsys, "card")
    assert card.read_text() == MINE and leftovers(tmp_path) == []


# ================================================================================================ training
def test_the_final_saves_private_folder_swapped_for_a_link_to_a_users_folder_moves_none_of_its_files(tmp_path):
    from switchhead.training.run_folder import _save_into

    victim = Victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    attacker = Attacker(run, victim)

    def write(folder):
        attacker.strike()
        Path(folder, "config.json").write_text("{}")
        Path(folder, "model.safetensors").write_bytes(b"weights")

    _save_into(str(run), write)
    assert attacker.struck
    victim.untouched()
    assert (run / "config.json").read_text() == "{}" and (run / "model.safetensors").read_bytes() == b"weights"


class _Accelerator:
    is_main_process, num_processes, process_index = True, 1, 0

    def wait_for_everyone(self):
        pass


def test_a_checkpoints_staging_folder_swapped_for_a_link_receives_nothing(tmp_path):
    from types import SimpleNamespace

    from switchhead.training.checkpoints import save_checkpoint

    victim = Victim(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    attacker = Attacker(run / "checkpoints", victim)

    class Placement:
        def save_state(self, folder):
            attacker.strike()
            Path(folder, "model.safetensors").write_bytes(b"weights")

    config = SimpleNamespace(to_dict=lambda: {"max_steps": 1}, keep_checkpoints=2)
    try:
        final = save_checkpoint(_Accelerator(), str(run), 1, config, [None], placement=Placement())
    except OutputError as error:
        assert "was replaced" in str(error)
    else:
        assert Path(final, "model.safetensors").read_bytes() == b"weights" and not Path(final).is_symlink()
        assert json.loads(Path(final, "checkpoint_state.json").read_text())["step"] == 1
    assert attacker.struck
    victim.untouched()


def test_folder_lock_on_a_full_disk_leaves_neither_its_file_nor_the_folder_it_made(tmp_path, monkeypatch):
    from switchhead.integrity import FolderLock

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(WriteError, match="No space left"):
        FolderLock(str(tmp_path / "new"), "train").acquire()
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(WriteError):
        FolderLock(str(existing), "finetune").acquire()
    assert os.listdir(existing) == []


# ================================================================================================ commands
def striking(write, attacker: Attacker):
    """`write` (a library's writer by name), the attacker striking just before it runs."""
    def wrapped(*args, **kwargs):
        attacker.strike()
        return write(*args, **kwargs)

    return wrapped


def _striking_write_text(monkeypatch, attacker: Attacker) -> None:
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if files.PARTIAL in str(self) or files.PARTIAL in self.name:
            attacker.strike()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


def test_card_output_whose_temporary_is_swapped_for_a_link_writes_only_the_card(model_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    attacker = Attacker(out, victim)
    _striking_write_text(monkeypatch, attacker)
    code = main(["card", str(model_dir), "--output", str(out / "card.md")])
    outcome(code, capsys, "card")
    assert attacker.struck
    victim.untouched()
    if code == 0:
        assert not (out / "card.md").is_symlink() and "SwitchHead" in (out / "card.md").read_text()


def test_upcycle_and_convert_staging_swapped_for_a_link_receive_nothing(tmp_path, capsys, monkeypatch):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense", vocab_size=64)).save_pretrained(dense)
    capsys.readouterr()
    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    attacker = Attacker(out, victim)
    with monkeypatch.context() as patch:
        patch.setattr(SwitchHeadForCausalLM, "save_pretrained", striking(SwitchHeadForCausalLM.save_pretrained,
                                                                         attacker))
        code = main(["upcycle", str(dense), str(out / "up"), "--heads", "2", "--experts", "2", "--k", "1"])
    capsys.readouterr() if code == 0 else outcome(code, capsys, "upcycle")
    assert attacker.struck
    victim.untouched()
    if code == 0:
        assert (out / "up").is_dir() and not (out / "up").is_symlink() and (out / "up" / "config.json").is_file()

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", striking(torch.save, attacker))
        code = main(["convert", "hf-to-authors", str(dense), str(out / "authors.pt")])
    capsys.readouterr() if code == 0 else outcome(code, capsys, "convert")
    victim.untouched()
    if code == 0:
        assert not (out / "authors.pt").is_symlink() and (out / "authors.pt").stat().st_size > 0


def test_eval_output_and_plots_swapped_for_links_write_only_their_own_files(plotted, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    attacker = Attacker(out, victim)
    _striking_write_text(monkeypatch, attacker)
    monkeypatch.setattr(Figure, "savefig", striking(Figure.savefig, attacker))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat because it was tired " * 10)
    code = main(["eval", str(plotted), "--perplexity", str(text), "--output", str(out / "results.json")])
    capsys.readouterr() if code == 0 else outcome(code, capsys, "eval")
    assert attacker.struck
    victim.untouched()
    if code == 0:
        assert "perplexity" in json.loads((out / "results.json").read_text())
    plots = out / "plots"
    plots.mkdir()
    attacker.folder, attacker.before = plots, set(os.listdir(plots))
    code = main(["eval", str(plotted), "--plots", str(plots), "--text", "the cat sat on a mat"])
    capsys.readouterr() if code == 0 else outcome(code, capsys, "eval")
    victim.untouched()
    written = [name for name in os.listdir(plots) if name.endswith(".png")]
    assert all(not (plots / name).is_symlink() for name in written)


def test_eval_output_on_a_read_only_disk_is_refused_before_the_evaluation(plotted, tmp_path, capsys, monkeypatch):
    import switchhead.evaluation.perplexity as perplexity

    def evaluated(*args, **kwargs):
        raise AssertionError("the evaluation ran before the output was found unwritable")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x"))

    monkeypatch.setattr(perplexity, "evaluate_perplexity", evaluated)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat " * 10)
    out = tmp_path / "out"
    out.mkdir()
    with monkeypatch.context() as patch:  # as the file system answers where root ignores permission bits
        patch.setattr(os, "mkdir", read_only)
        patch.setattr(tempfile, "mkstemp", read_only)
        assert main(["eval", str(plotted), "--perplexity", str(text), "--output", str(out / "r.json")]) == 2
    assert f"cannot write {out / 'r.json'}" in one_error_line(capsys, "eval")
    assert os.listdir(out) == []


def test_export_whose_temporary_is_swapped_for_a_link_writes_only_the_onnx_file(model_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    pytest.importorskip("onnxscript")
    import torch.onnx

    victim = Victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"old")
    attacker = Attacker(out, victim)
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", striking(torch.onnx.ONNXProgram.save, attacker))
    code = main(["export", str(model_dir), str(out / "model.onnx"), "--overwrite"])
    capsys.readouterr() if code == 0 else outcome(code, capsys, "export")
    assert attacker.struck
    victim.untouched()
    assert not (out / "model.onnx").is_symlink()


# ================================================================================================ publish
class _Hub:
    """Reads every operation's bytes when the commit is made; `pending` runs while create_repo is 'in flight'."""

    def __init__(self, pending=None):
        self.pending, self.files = pending, {}

    def create_repo(self, **kwargs):
        if self.pending:
            self.pending()

    def create_commit(self, *, operations, **kwargs):
        for operation in operations:
            source = operation.path_or_fileobj
            self.files[operation.path_in_repo] = source if isinstance(source, bytes) else \
                source.read() if hasattr(source, "read") else Path(source).read_bytes()


def _publishable(tmp_path: Path, model_dir: Path) -> tuple[Path, Path]:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    return folder, secret


def test_publish_uploads_the_bytes_it_checked_when_a_file_is_swapped_for_a_link_during_the_hub_call(
        model_dir, tmp_path):
    from switchhead.evaluation.card import publish

    folder, secret = _publishable(tmp_path, model_dir)
    config = (folder / "config.json").read_bytes()

    def swap():
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(secret)

    hub = _Hub(swap)
    publish(folder, "me/tiny", "card", api=hub)
    assert hub.files["config.json"] == config and SECRET not in hub.files.values()


def test_publish_checks_the_results_bytes_it_uploads_when_the_file_is_replaced_after_a_check_by_name(
        model_dir, tmp_path, monkeypatch):
    import json

    from switchhead.evaluation.card import publish
    from switchhead.integrity import files

    folder, _ = _publishable(tmp_path, model_dir)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": {"switchhead_lambada": {"acc": 0.5}}}))
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({"token": SECRET.decode("latin-1")}))
    opened = files.open_for_upload

    def replaced_first(folder_name, name):
        # a plain file (one name, no link) put in the results file's place once any check by name has passed
        if os.path.join(folder_name, name) == str(results) and credentials.exists():
            os.replace(credentials, results)
        return opened(folder_name, name)

    monkeypatch.setattr(files, "open_for_upload", replaced_first)
    hub = _Hub()
    with pytest.raises(ValueError, match="no 'results' mapping"):
        publish(folder, "me/tiny", "card", api=hub, results=results)
    assert not hub.files


def test_publish_refuses_a_hard_link_in_the_folder_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    folder, secret = _publishable(tmp_path, model_dir)
    (folder / "tokenizer.json").unlink(missing_ok=True)
    os.link(secret, folder / "tokenizer.json")
    hub = _Hub()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: hub)
    assert main(["publish", str(folder), "me/tiny"]) == 2
    assert "hard links" in one_error_line(capsys, "publish")
    assert not hub.files


# ================================================================================================ finetune
@pytest.mark.integration
def test_finetune_merge_and_json_never_write_through_links_planted_during_the_run(plotted, tmp_path, capsys,
                                                                                   monkeypatch):
    import peft

    victim = Victim(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat because it was tired.\n" * 200)
    out = tmp_path / "out"
    real_save = peft.PeftModel.save_pretrained

    def save_pretrained(self, folder, *args, **kwargs):  # the adapter's save: plant links for what comes next
        for name, target in (("merged", victim.folder), ("finetune.json", victim.file)):
            if not (out / name).is_symlink():
                (out / name).symlink_to(target)
        return real_save(self, folder, *args, **kwargs)

    monkeypatch.setattr(peft.PeftModel, "save_pretrained", save_pretrained)
    code = main(["finetune", str(plotted), "--data", str(text), "--output-dir", str(out), "--max-steps", "2",
                 "--batch-size", "2", "--block-size", "16", "--merge"])
    outcome(code, capsys, "finetune")
    victim.untouched()


def test_a_folder_output_published_without_interference_keeps_every_file(tmp_path):
    with files.staging_folder(str(tmp_path)) as staged:
        Path(staged.here, "config.json").write_text("{}")
        Path(staged.here, "sub").mkdir()
        Path(staged.here, "sub", "a.bin").write_bytes(b"a")
        staged.publish_as("model", mode=files.new_folder_mode())
    assert sorted(os.listdir(tmp_path)) == ["model"]
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    assert (tmp_path / "model" / "sub" / "a.bin").read_bytes() == b"a"
    assert stat.S_IMODE(os.stat(tmp_path / "model").st_mode) == files.new_folder_mode()
