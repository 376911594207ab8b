"""Hostile output paths: what a command writes never goes through a link it did not create, never replaces a FIFO,
a device or a socket, never leaves half a file, and a full or read-only disk ends in one line.

The writer (`switchhead.integrity.files`) is tested in process, case by case; then the commands that use it: `card`,
`eval --output / --plots`, `export`, `convert`, `upcycle`, `finetune`, and a training run's own files (its marker,
log.csv, events.log, tensorboard/, checkpoints/). A read-only disk is a folder of mode 0555 where the tests do not
run as root (root writes anywhere), else an injected EROFS; a full disk is an injected ENOSPC. Signals: Ctrl-C
during `train` ends it with exit code 130 and a verified checkpoint that resumes; SIGINT or SIGTERM during
`export --overwrite` leaves the old file and no temporary one.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.runs import corpus  # noqa: F401 - the module-scoped fixture: data, tokenizer

from switchhead.cli import main
from switchhead.integrity import LOCK_NAME, MANIFEST, OutputError, Terminated, WriteError
from switchhead.integrity.files import (PARTIAL, atomic_file, check_target, clear_stops, make_folder, open_append,
                                       record_stop, write_error)

MINE = "the user's own bytes\n"
ROOT = os.geteuid() == 0


def users_file(folder: Path, name: str = "mine.txt") -> Path:
    path = folder / name
    path.write_text(MINE)
    return path


def interruptible() -> None:
    """In the child before it starts: Ctrl-C as in a terminal. A shell starts a background job (a test run among
    them) with SIGINT ignored, its children inherit that, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def leftovers(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith(PARTIAL) or ".partial-" in name)


def write(destination, text: str = "new\n", overwrite: bool = True) -> None:
    with atomic_file(str(destination), overwrite) as temporary:
        Path(temporary).write_text(text)


PROGRESS = ("it/s]", "s/it]", "windows (")  # progress bars of a model that loaded, counted by other tests


def one_error_line(capsys, command: str) -> str:
    """The one error line of the contract: last on stderr, no traceback, nothing else but the progress bars of a
    model that loaded before the failure (those are another test's subject)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("switchhead ")]
    assert len(ours) == 1 and ours[0] == lines[-1] and ours[0].startswith(f"switchhead {command}: error: "), err
    assert all(any(mark in line for mark in PROGRESS) for line in lines[:-1]), err
    return ours[0]


# ================================================================================================ the writer
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_at_the_destination_is_refused_and_its_target_keeps_its_bytes(tmp_path, overwrite):
    mine = users_file(tmp_path)
    link = tmp_path / "out.json"
    link.symlink_to(mine)
    with pytest.raises(OutputError, match="symbolic link"):
        write(link, overwrite=overwrite)
    assert mine.read_text() == MINE and link.is_symlink() and not leftovers(tmp_path)


def test_a_dangling_link_is_refused_and_nothing_appears_where_it_points(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "elsewhere" / "created.json")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OutputError, match="symbolic link"):
        write(link)
    assert not (tmp_path / "elsewhere" / "created.json").exists() and link.is_symlink()


def test_a_link_to_a_folder_is_refused(tmp_path):
    folder = tmp_path / "users"
    folder.mkdir()
    (tmp_path / "out.json").symlink_to(folder)
    with pytest.raises(OutputError, match="symbolic link"):
        write(tmp_path / "out.json")
    assert os.listdir(folder) == []


def test_a_link_to_the_processes_stdout_is_refused(tmp_path):
    (tmp_path / "out.txt").symlink_to("/proc/self/fd/1")
    with pytest.raises(OutputError, match="symbolic link"):
        write(tmp_path / "out.txt")
    assert (tmp_path / "out.txt").is_symlink()


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="a FIFO"):
        write(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_socket_is_refused(tmp_path):
    path = tempfile.mktemp(prefix="s", dir=tmp_path)  # short: a socket path has a length limit
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    try:
        with pytest.raises(OutputError, match="a socket"):
            write(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        server.close()


def test_a_character_device_is_refused(tmp_path):
    """A null device made in the test's folder (root can make one); elsewhere /dev/null itself, which the check
    refuses before anything is created beside it."""
    if ROOT:
        device = tmp_path / "null"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        device = Path("/dev/null")
    with pytest.raises(OutputError, match="a character device"):
        write(device)
    assert stat.S_ISCHR(os.lstat(device).st_mode)
    assert not [name for name in os.listdir(device.parent) if name.startswith(PARTIAL)]


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputError, match="a folder"):
        write(tmp_path / "out")


def test_an_existing_file_needs_overwrite_and_keeps_its_permissions(tmp_path):
    target = users_file(tmp_path, "out.txt")
    os.chmod(target, 0o640)
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        write(target, overwrite=False)
    assert target.read_text() == MINE
    write(target, "new\n", overwrite=True)
    assert target.read_text() == "new\n" and stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert not leftovers(tmp_path)


def test_a_hard_linked_destination_is_replaced_by_name_and_the_other_name_keeps_its_bytes(tmp_path):
    mine = users_file(tmp_path)
    os.link(mine, tmp_path / "out.txt")
    write(tmp_path / "out.txt")
    assert (tmp_path / "out.txt").read_text() == "new\n" and mine.read_text() == MINE


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyboardInterrupt(), Terminated()],
                         ids=["error", "ctrl-c", "sigterm"])
def test_a_write_that_ends_early_leaves_the_old_file_and_no_temporary_one(tmp_path, error):
    target = users_file(tmp_path, "out.txt")
    with pytest.raises(type(error)):
        with atomic_file(str(target)) as temporary:
            Path(temporary).write_text("half")
            raise error
    assert target.read_text() == MINE and not leftovers(tmp_path)


def test_a_temporary_file_swapped_for_a_link_while_written_is_never_renamed_into_place(tmp_path):
    mine = users_file(tmp_path)
    with pytest.raises(OutputError, match="was replaced while it was written"):
        with atomic_file(str(tmp_path / "out.txt")) as temporary:
            os.unlink(temporary)
            os.symlink(mine, temporary)
    assert mine.read_text() == MINE and not (tmp_path / "out.txt").exists()


def test_a_temporary_file_swapped_for_a_hard_link_to_a_users_file_is_never_renamed_into_place(tmp_path):
    mine = users_file(tmp_path)
    with pytest.raises(OutputError, match="was replaced while it was written"):
        with atomic_file(str(tmp_path / "out.txt")) as temporary:
            os.unlink(temporary)
            os.link(mine, temporary)
    assert mine.read_text() == MINE and not (tmp_path / "out.txt").exists() and not leftovers(tmp_path)


def test_a_writer_that_replaces_the_temporary_file_by_its_own_rename_is_published(tmp_path):
    """safetensors and others write a file of their own and rename it over the path they were given."""
    with atomic_file(str(tmp_path / "out.txt")) as temporary:
        Path(temporary + ".own").write_text("written by rename")
        os.replace(temporary + ".own", temporary)
    assert (tmp_path / "out.txt").read_text() == "written by rename" and not leftovers(tmp_path)


def test_a_node_planted_at_the_destination_while_written_is_not_replaced(tmp_path):
    with pytest.raises(OutputError, match="a FIFO"):
        with atomic_file(str(tmp_path / "out.txt")) as temporary:
            Path(temporary).write_text("new")
            os.mkfifo(tmp_path / "out.txt")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out.txt").st_mode) and not leftovers(tmp_path)


def test_a_stale_link_at_a_predictable_temporary_name_is_never_written_through(tmp_path):
    mine = users_file(tmp_path)
    for name in ("out.txt.tmp", f"{PARTIAL}out.txt", ".out.txt.tmp"):
        (tmp_path / name).symlink_to(mine)
    write(tmp_path / "out.txt")
    assert mine.read_text() == MINE and (tmp_path / "out.txt").read_text() == "new\n"


def test_names_with_newlines_and_names_as_long_as_the_file_system_allows(tmp_path):
    for name in ("two\nlines.json", "x" * 250 + ".png", " leading space", "-dash", "ünïcödé.txt"):
        write(tmp_path / name, name)
        assert (tmp_path / name).read_text() == name
    assert not leftovers(tmp_path)


def test_a_missing_folder_is_an_error_naming_the_output(tmp_path):
    with pytest.raises(FileNotFoundError):
        write(tmp_path / "no-such-folder" / "out.txt")


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_is_a_write_error_naming_the_destination(tmp_path, monkeypatch):
    target = users_file(tmp_path, "out.txt")

    def fill(temporary):
        with open(temporary, "w") as handle:
            handle.write("half")
        _no_space()

    with pytest.raises(WriteError) as raised:
        with atomic_file(str(target)) as temporary:
            fill(temporary)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert target.read_text() == MINE and not leftovers(tmp_path)


def test_torch_and_safetensors_reports_of_a_full_disk_are_write_errors(tmp_path):
    destination = str(tmp_path / "out")
    for error in (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8256 vs 8148"),
                  RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
                  type("SafetensorError", (Exception,), {})("Error while serializing: IoError(Os { code: 28, kind: "
                                                            "StorageFull, message: \"No space left on device\" })")):
        failure = write_error(error, destination)
        assert isinstance(failure, WriteError) and failure.errno == errno.ENOSPC, error
    assert write_error(RuntimeError("shape mismatch"), destination).args == ("shape mismatch",)
    wrapped = ValueError("unrelated")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise wrapped from None  # a message of its own, not about the disk
    except ValueError:
        pass
    assert write_error(wrapped, destination) is wrapped


def test_a_read_only_folder_is_a_write_error_and_leaves_nothing(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    if ROOT:  # root ignores permission bits: the file system says EROFS instead
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / "x"))
        monkeypatch.setattr(os, "mkdir", read_only)
    else:
        folder.chmod(0o555)
    try:
        with pytest.raises(WriteError) as raised:
            write(folder / "out.txt")
    finally:
        folder.chmod(0o755)
    assert raised.value.errno in (errno.EROFS, errno.EACCES) and raised.value.filename == str(folder / "out.txt")
    assert os.listdir(folder) == []


def test_a_rename_refused_by_a_read_only_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = users_file(tmp_path, "out.txt")

    def read_only(source, destination, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), source)

    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(WriteError, match="Read-only"):
        write(target)
    monkeypatch.undo()
    assert target.read_text() == MINE and not leftovers(tmp_path)


def test_appends_refuse_links_fifos_folders_and_hard_links_and_recheck_on_every_open(tmp_path):
    mine = users_file(tmp_path)
    log = tmp_path / "log.csv"
    with open_append(str(log)) as handle:
        handle.write("row 1\n")
    assert log.read_text() == "row 1\n"
    log.unlink()
    log.symlink_to(mine)  # planted between two appends
    with pytest.raises(OutputError, match="symbolic link"):
        open_append(str(log))
    log.unlink()
    os.link(mine, log)
    with pytest.raises(OutputError, match="hard links"):
        open_append(str(log))
    log.unlink()
    os.mkfifo(log)
    with pytest.raises(OutputError, match="FIFO"):
        open_append(str(log))
    log.unlink()
    log.mkdir()
    with pytest.raises(OutputError, match="folder"):
        open_append(str(log))
    assert mine.read_text() == MINE


def test_a_folder_of_the_commands_own_is_refused_when_something_else_is_at_its_name(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (tmp_path / "tensorboard").symlink_to(users)
    with pytest.raises(OutputError, match="symbolic link"):
        make_folder(str(tmp_path / "tensorboard"))
    users_file(tmp_path, "checkpoints")
    with pytest.raises(OutputError, match="not a regular file|where this command keeps"):
        make_folder(str(tmp_path / "checkpoints"))
    assert make_folder(str(tmp_path / "new" / "deep")) and (tmp_path / "new" / "deep").is_dir()
    assert os.listdir(users) == []


def test_check_target_accepts_an_absent_path_and_a_regular_file_only_with_overwrite(tmp_path):
    check_target(str(tmp_path / "absent"))
    check_target(str(tmp_path / "absent" / "below"))  # the missing folder is the write's own error
    target = users_file(tmp_path)
    check_target(str(target), overwrite=True)
    with pytest.raises(OutputError, match="--force"):
        check_target(str(target), overwrite=False, option="--force")


# ================================================================================================ the command line
def replace_flops(monkeypatch, handler) -> None:
    """`switchhead flops` runs `handler` instead (registration reads the module's function at each `main`)."""
    from switchhead.cli import evaluate

    monkeypatch.setattr(evaluate, "run_flops", handler)


def test_the_dispatcher_maps_a_refused_write_to_one_line_and_keeps_tracebacks_for_bugs(monkeypatch, capsys):
    for error, words in ((OSError(errno.EROFS, "Read-only file system", "/x/out"), "cannot write /x/out: Read-only"),
                         (OSError(errno.ENOSPC, "No space left on device"), "cannot write: No space left on device"),
                         (OSError(errno.EDQUOT, "Disk quota exceeded", "/x"), "cannot write /x: Disk quota"),
                         (WriteError(errno.EACCES, "Permission denied", "/x/out"), "cannot write /x/out: Permission"),
                         (OutputError("output '/x' is a FIFO, not a regular file"), "is a FIFO")):
        def handler(args, error=error):
            raise error
        replace_flops(monkeypatch, handler)
        assert main(["flops", "tiny-switchhead"]) == 2
        assert words in one_error_line(capsys, "flops")

    def reset(args):
        raise OSError(errno.ECONNRESET, "Connection reset by peer")
    replace_flops(monkeypatch, reset)
    with pytest.raises(OSError):  # not a write the disk refused: a bug or an environment problem keeps its traceback
        main(["flops", "tiny-switchhead"])


def test_sigterm_during_a_command_cleans_up_like_ctrl_c_and_exits_143(tmp_path, monkeypatch, capsys):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    target = users_file(tmp_path, "out.txt")

    def killed(args):
        with atomic_file(str(target)) as temporary:
            Path(temporary).write_text("half")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        return 0

    replace_flops(monkeypatch, killed)
    started = time.time()
    assert main(["flops", "tiny-switchhead"]) == 143
    assert time.time() - started < 4
    assert capsys.readouterr().err.strip() == "switchhead flops: terminated"
    assert target.read_text() == MINE and not leftovers(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    folder = tmp_path_factory.mktemp("model") / "tiny"
    torch.manual_seed(0)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64)).save_pretrained(folder)
    return folder


def nodes(tmp_path: Path) -> dict[str, Path]:
    """A link to a user's file, a dangling link, a link to stdout, a FIFO, a character device (root) or /dev/null."""
    mine = users_file(tmp_path)
    found = {}
    for name, target in (("link", mine), ("dangling", tmp_path / "nowhere"), ("stdout", "/proc/self/fd/1")):
        found[name] = tmp_path / f"{name}.out"
        found[name].symlink_to(target)
    found["fifo"] = tmp_path / "fifo.out"
    os.mkfifo(found["fifo"])
    if ROOT:
        found["device"] = tmp_path / "null.out"
        os.mknod(found["device"], 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        found["device"] = Path("/dev/null")
    return found


def unchanged(found: dict[str, Path]) -> None:
    assert found["link"].is_symlink() and found["dangling"].is_symlink() and found["stdout"].is_symlink()
    assert (found["link"].parent / "mine.txt").read_text() == MINE and not (found["link"].parent / "nowhere").exists()
    assert stat.S_ISFIFO(os.lstat(found["fifo"]).st_mode) and stat.S_ISCHR(os.lstat(found["device"]).st_mode)


@pytest.mark.parametrize("node", ["link", "dangling", "stdout", "fifo", "device"])
def test_card_output_refuses_links_fifos_and_devices_even_with_overwrite(model_dir, tmp_path, capsys, node):
    found = nodes(tmp_path)
    assert main(["card", str(model_dir), "--output", str(found[node]), "--overwrite"]) == 2
    line = one_error_line(capsys, "card")
    assert "symbolic link" in line or "not a regular file" in line, line
    unchanged(found)
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("node", ["link", "dangling", "stdout", "fifo", "device"])
def test_eval_and_export_outputs_refuse_links_fifos_and_devices_even_with_overwrite(model_dir, tmp_path, capsys,
                                                                                      node):
    found = nodes(tmp_path)
    text = users_file(tmp_path, "text.txt")
    assert main(["eval", str(model_dir), "--output", str(found[node]), "--overwrite", "--perplexity", str(text)]) == 2
    line = one_error_line(capsys, "eval")
    assert "symbolic link" in line or "not a regular file" in line, line
    assert main(["export", str(model_dir), str(found[node]), "--overwrite"]) == 2
    line = one_error_line(capsys, "export")
    assert "symbolic link" in line or "not a regular file" in line, line
    unchanged(found)


def test_outputs_over_the_model_folders_own_files_are_refused(model_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    for name in ("config.json", "model.safetensors"):
        assert main(["card", str(model), "--output", str(model / name), "--overwrite"]) == 2
        assert "file of the model folder being read" in one_error_line(capsys, "card")
        assert main(["export", str(model), str(model / name), "--overwrite"]) == 2
        assert "file of the model folder being read" in one_error_line(capsys, "export")
        assert main(["eval", str(model), "--output", str(model / name), "--overwrite", "--perplexity",
                     str(model / "config.json")]) == 2
        assert "file of the model folder being read" in one_error_line(capsys, "eval")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_card_refuses_an_existing_card_without_overwrite_and_replaces_it_with(model_dir, tmp_path, capsys):
    card = users_file(tmp_path, "README.md")
    assert main(["card", str(model_dir), "--output", str(card)]) == 2
    assert "already exists" in one_error_line(capsys, "card")
    assert card.read_text() == MINE
    assert main(["card", str(model_dir), "--output", str(card), "--overwrite"]) == 0
    assert card.read_text() != MINE and "switchhead" in card.read_text().lower()
    capsys.readouterr()
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_card_on_a_full_or_read_only_disk_exits_2_in_one_line_and_leaves_no_file(model_dir, tmp_path, capsys,
                                                                                  monkeypatch, code):
    out = tmp_path / "card.md"
    real_write_text = Path.write_text

    def refused(self, *args, **kwargs):
        if self.name.startswith(PARTIAL):
            real_write_text(self, "half")
            raise OSError(code, os.strerror(code))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refused)
    assert main(["card", str(model_dir), "--output", str(out)]) == 2
    line = one_error_line(capsys, "card")
    assert line == f"switchhead card: error: cannot write {out}: {os.strerror(code)}", line
    assert os.listdir(tmp_path) == []


def test_card_in_a_read_only_folder_exits_2_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    if ROOT:
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(os, "mkdir", read_only)
    else:
        folder.chmod(0o555)
    try:
        assert main(["card", str(model_dir), "--output", str(folder / "card.md")]) == 2
    finally:
        folder.chmod(0o755)
    assert "cannot write" in one_error_line(capsys, "card")
    assert os.listdir(folder) == []


def test_eval_output_on_a_full_disk_exits_2_and_leaves_no_file(plotted, tmp_path, capsys, monkeypatch):
    out = tmp_path / "results.json"
    real_write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith(PARTIAL):
            real_write_text(self, "{")
            _no_space()
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    text = tmp_path / "text.txt"
    text.write_text("a b c d e f g h " * 20)
    assert main(["eval", str(plotted), "--perplexity", str(text), "--output", str(out)]) == 2
    assert "cannot write" in one_error_line(capsys, "eval")
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]


# ---------------------------------------------------------------------------------------------------- plots
@pytest.fixture(scope="module")
def plotted(model_dir):
    """The tokenizer a plot needs (a tiny word-level one saved beside a copy of the model)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = model_dir.parent / "with-tokenizer"
    if not folder.exists():
        shutil.copytree(model_dir, folder)
        words = ["[UNK]", *"the cat sat on a mat because it was tired".split()]
        vocab = {word: index for index, word in enumerate(words)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_plots_refuse_a_link_in_the_folder_and_an_existing_png_before_writing_any(plotted, tmp_path, capsys):
    from switchhead import SwitchHeadConfig
    from switchhead.evaluation.analysis import plot_names

    names = plot_names(SwitchHeadConfig.from_pretrained(plotted))
    plots = tmp_path / "plots"
    plots.mkdir()
    mine = users_file(tmp_path)
    (plots / names[-1]).symlink_to(mine)
    assert main(["eval", str(plotted), "--plots", str(plots), "--overwrite"]) == 2
    assert "symbolic link" in one_error_line(capsys, "eval")
    assert sorted(os.listdir(plots)) == [names[-1]] and mine.read_text() == MINE

    (plots / names[-1]).unlink()
    png = plots / names[0]
    png.write_bytes(b"the user's own picture")
    assert main(["eval", str(plotted), "--plots", str(plots)]) == 2
    assert "already exists; pass --overwrite" in one_error_line(capsys, "eval")
    assert sorted(os.listdir(plots)) == [names[0]] and png.read_bytes() == b"the user's own picture"

    assert main(["eval", str(plotted), "--plots", str(plots), "--overwrite"]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(plots)) == sorted(names)
    assert png.read_bytes().startswith(b"\x89PNG")


def test_plots_on_a_full_disk_exit_2_and_leave_no_partial_png(plotted, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    plots = tmp_path / "plots"
    saved = Figure.savefig
    calls = []

    def fills(self, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\x89PNG half")
            _no_space()
        return saved(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", fills)
    assert main(["eval", str(plotted), "--plots", str(plots)]) == 2
    assert "cannot write" in one_error_line(capsys, "eval")
    assert len(os.listdir(plots)) == 1 and not leftovers(plots)  # the first plot, whole; no half of the second


# ---------------------------------------------------------------------------------------------------- export
def test_export_on_a_full_disk_keeps_the_old_file_and_leaves_no_partial_file(model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    previous = users_file(tmp_path, "model.onnx")

    class Program:
        model_proto = SimpleNamespace(opset_import=[])

        def save(self, path, external_data=False):
            Path(path).write_bytes(b"half an onnx file")
            _no_space()

    monkeypatch.setattr(torch.onnx, "export", lambda *args, **kwargs: Program())
    assert main(["export", str(model_dir), str(previous), "--overwrite"]) == 2
    assert one_error_line(capsys, "export") == f"switchhead export: error: cannot write {previous}: " \
                                                f"{os.strerror(errno.ENOSPC)}"
    assert previous.read_text() == MINE and sorted(os.listdir(tmp_path)) == ["model.onnx"]


# ---------------------------------------------------------------------------------------------------- convert, upcycle
def test_upcycle_and_convert_on_a_read_only_disk_exit_2_and_leave_nothing(model_dir, tmp_path, capsys, monkeypatch):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense", vocab_size=64)).save_pretrained(dense)
    capsys.readouterr()  # the save's progress bar
    out = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x"))

    with monkeypatch.context() as patch:
        patch.setattr(os, "mkdir", read_only)
        assert main(["upcycle", str(dense), str(out), "--heads", "2", "--experts", "2", "--k", "1"]) == 2
        assert one_error_line(capsys, "upcycle") == f"switchhead upcycle: error: cannot write {out}: " \
                                                    f"{os.strerror(errno.EROFS)}"
        assert sorted(os.listdir(tmp_path)) == before
        assert main(["convert", "hf-to-authors", str(model_dir), str(tmp_path / "authors.pt")]) == 2
        assert one_error_line(capsys, "convert") == f"switchhead convert: error: cannot write " \
                                                    f"{tmp_path / 'authors.pt'}: {os.strerror(errno.EROFS)}"
        assert sorted(os.listdir(tmp_path)) == before


def test_upcycle_on_a_full_disk_exits_2_and_leaves_no_partial_folder(tmp_path, capsys, monkeypatch):
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense", vocab_size=64)).save_pretrained(dense)
    capsys.readouterr()  # the save's progress bar
    before = sorted(os.listdir(tmp_path))

    def full(tensors, filename, *args, **kwargs):  # how safetensors reports a full disk
        Path(filename).write_bytes(b"half")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    assert main(["upcycle", str(dense), str(tmp_path / "up"), "--heads", "2", "--experts", "2", "--k", "1"]) == 2
    line = one_error_line(capsys, "upcycle")
    assert line == f"switchhead upcycle: error: cannot write {tmp_path / 'up'}: No space left on device", line
    assert sorted(os.listdir(tmp_path)) == before


def test_convert_to_its_own_input_path_is_refused(tmp_path, capsys):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense", vocab_size=64)).save_pretrained(dense)
    capsys.readouterr()  # the save's progress bar
    before = {p.name: p.read_bytes() for p in dense.iterdir()}
    assert main(["upcycle", str(dense), str(dense), "--heads", "2", "--experts", "2", "--k", "1"]) == 2
    assert "already exists" in one_error_line(capsys, "upcycle")
    assert {p.name: p.read_bytes() for p in dense.iterdir()} == before


def test_convert_onto_a_link_or_a_fifo_is_refused(model_dir, tmp_path, capsys):
    found = nodes(tmp_path)
    for node, words in (("link", "already exists"), ("dangling", "symbolic link"), ("fifo", "a FIFO")):
        assert main(["convert", "hf-to-authors", str(model_dir), str(found[node])]) == 2
        assert words in one_error_line(capsys, "convert"), node
    unchanged(found)


# ================================================================================================ training runs
def fake_accelerator():
    return SimpleNamespace(is_main_process=True, num_processes=1, process_index=0,
                           wait_for_everyone=lambda: None, device=torch.device("cpu"))


def test_a_runs_tensorboard_folder_linked_to_a_users_folder_gets_no_event_file(tmp_path):
    from switchhead.training.run_folder import RunLog

    users = tmp_path / "users"
    users.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to(users)
    with pytest.raises(OutputError, match="symbolic link"):
        RunLog(str(run), 0, tensorboard=True, enabled=True)
    assert os.listdir(users) == []


def test_a_link_planted_at_log_csv_while_the_run_goes_on_receives_no_row(tmp_path):
    from switchhead.training.run_folder import RunLog

    mine = users_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    log = RunLog(str(run), 0, tensorboard=False, enabled=True)
    log.write({"step": 1, "loss": "1.0"})
    assert (run / "log.csv").read_text().splitlines()[1].startswith("1,1.0")
    (run / "log.csv").unlink()
    (run / "log.csv").symlink_to(mine)
    with pytest.raises(OutputError, match="symbolic link"):
        log.write({"step": 2, "loss": "0.5"})
    assert mine.read_text() == MINE
    with pytest.raises(OutputError, match="symbolic link"):  # nor is it read or replaced on a resume
        RunLog(str(run), 1, tensorboard=False, enabled=True)
    assert mine.read_text() == MINE and (run / "log.csv").is_symlink()


def test_events_log_is_never_appended_through_a_link(tmp_path):
    from switchhead.training.checkpoints import log_event

    mine = users_file(tmp_path)
    (tmp_path / "events.log").symlink_to(mine)
    with pytest.raises(OutputError, match="symbolic link"):
        log_event(str(tmp_path), "fell back to an older checkpoint")
    assert mine.read_text() == MINE


def test_the_run_marker_is_written_through_no_stale_temporary_link(tmp_path):
    from switchhead.training.run_folder import RUN_MARKER, _write_json

    mine = users_file(tmp_path)
    (tmp_path / f"{RUN_MARKER}.tmp").symlink_to(mine)
    _write_json(str(tmp_path / RUN_MARKER), {"preset": "tiny"})
    assert mine.read_text() == MINE and json.loads((tmp_path / RUN_MARKER).read_text()) == {"preset": "tiny"}
    (tmp_path / RUN_MARKER).unlink()
    (tmp_path / RUN_MARKER).symlink_to(mine)
    with pytest.raises(OutputError):
        _write_json(str(tmp_path / RUN_MARKER), {"preset": "tiny"})
    assert mine.read_text() == MINE


def test_a_checkpoints_folder_linked_elsewhere_is_refused_before_anything_is_written(tmp_path):
    from switchhead.training.checkpoints import save_checkpoint

    users = tmp_path / "users"
    users.mkdir()
    (users / ".tmp-step-0000002").mkdir()  # a save into the link would first delete this
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(users)
    with pytest.raises(OutputError, match="symbolic link"):
        save_checkpoint(fake_accelerator(), str(run), 2, None, [])
    assert os.listdir(users) == [".tmp-step-0000002"]


def test_the_final_save_replaces_no_link_planted_at_a_files_name(tmp_path):
    from switchhead.training.run_folder import _save_into

    mine = users_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").symlink_to(mine)
    (run / ".tmp-save").symlink_to(tmp_path)  # the fixed name used before: never entered

    def write(folder):
        Path(folder, "config.json").write_text("{}")

    with pytest.raises(OutputError, match="symbolic link"):
        _save_into(str(run), write)
    assert mine.read_text() == MINE and (run / "config.json").is_symlink()
    assert sorted(os.listdir(run)) == [".tmp-save", "config.json"]  # its temporary folder is gone


def test_train_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    target = users_file(tmp_path, "run")
    assert main(["train", "--output-dir", str(target), "--max-steps", "1", "--no-progress"]) == 2
    assert "is a file, not a folder" in one_error_line(capsys, "train")
    assert target.read_text() == MINE


# ---------------------------------------------------------------------------------------------------- subprocesses
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def run_args(corpus, output: Path, steps: int, *extra: str) -> list[str]:
    data, tokenizer = corpus
    return ["train", "--preset", "tiny-switchhead", "--data", data, "--tokenizer", tokenizer, "--output-dir",
            str(output), "--max-steps", str(steps), "--block-size", "32", "--batch-size", "4", "--log-every", "1",
            "--eval-every", "1000", "--eval-batches", "1", "--save-every", "1000", "--no-progress", *extra]


@pytest.mark.integration
@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_a_signal_during_train_exits_with_a_verified_checkpoint_that_resumes(corpus, tmp_path, number, code):
    """The signal arrives after a few logged steps (no periodic checkpoint yet: --save-every 1000); the run saves
    the step under way, verified against its manifest, and `--resume` continues from it to the end."""
    from switchhead.integrity import verify_manifest
    from switchhead.training import checkpoint_dirs

    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "switchhead.cli", *run_args(corpus, run, 100000,
                                                                                  "--no-tensorboard")],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:
            log = run / "log.csv"
            if log.exists() and len(log.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        process.send_signal(number)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "saved and verified: continue with --resume" in lines[0], err
    found = checkpoint_dirs(str(run))
    assert len(found) == 1 and verify_manifest(found[0]) == []
    step = int(Path(found[0]).name.split("-")[1])
    assert step >= 3
    assert not (run / LOCK_NAME).exists()
    resumed = subprocess.run([sys.executable, "-m", "switchhead.cli",
                              *run_args(corpus, run, step + 2, "--no-tensorboard", "--resume")], env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {step}" in resumed.stdout
    assert (run / MANIFEST).exists()


@pytest.mark.integration
def test_train_writes_through_no_stale_marker_link_fresh_or_overwritten(corpus, tmp_path, capsys):
    mine = users_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_config.json.tmp").symlink_to(mine)
    assert main(run_args(corpus, run, 2, "--no-tensorboard")) == 0
    assert mine.read_text() == MINE
    assert main(run_args(corpus, run, 2, "--no-tensorboard", "--overwrite")) == 0
    assert mine.read_text() == MINE
    capsys.readouterr()
    assert json.loads((run / "training_config.json").read_text())["max_steps"] == 2
    assert not leftovers(run)


@pytest.mark.integration
def test_a_resume_with_a_linked_tensorboard_folder_exits_2_and_the_users_folder_stays_empty(corpus, tmp_path,
                                                                                           capsys):
    import shutil

    users = tmp_path / "users"
    users.mkdir()
    run = tmp_path / "run"
    assert main(run_args(corpus, run, 2, "--report-to", "tensorboard")) == 0  # the resume keeps the run's trackers
    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").symlink_to(users)
    capsys.readouterr()
    assert main(run_args(corpus, run, 4, "--resume")) == 2
    assert "symbolic link" in one_error_line(capsys, "train")
    assert os.listdir(users) == []


@pytest.mark.integration
@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_a_signal_during_export_overwrite_keeps_the_old_file_and_no_partial_one(model_dir, tmp_path, number, code):
    previous = users_file(tmp_path, "model.onnx")
    process = subprocess.Popen([sys.executable, "-m", "switchhead.cli", "export", str(model_dir), str(previous),
                                "--overwrite"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None and not leftovers(tmp_path):
            time.sleep(0.05)
        assert leftovers(tmp_path), "the export never started writing"
        process.send_signal(number)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, err
    assert previous.read_text() == MINE and sorted(os.listdir(tmp_path)) == ["model.onnx"], err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_finetune_on_a_full_or_read_only_disk_exits_2_and_leaves_no_folder(tmp_path, capsys, monkeypatch, code):
    pytest.importorskip("peft")
    from helpers.hub_folder import save_hub_folder

    from switchhead.training import finetune as finetuning

    model = tmp_path / "model"
    save_hub_folder(model, "tiny-switchhead")
    capsys.readouterr()  # the save's progress bar
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 400)

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "adapter" / "adapter_model.safetensors"))

    monkeypatch.setattr(finetuning, "_finetune", lambda *args, **kwargs: (
        (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"half"), refused()))
    assert main(["finetune", str(model), "--data", str(text), "--output-dir", str(tmp_path / "adapter"),
                 "--max-steps", "1"]) == 2
    line = one_error_line(capsys, "finetune")
    assert line.startswith(f"switchhead finetune: error: cannot write {tmp_path / 'adapter'}"), line
    assert sorted(os.listdir(tmp_path)) == ["model", "text.txt"]


# ------------------------------------------------------------------------------ a stop that a library swallowed
def test_a_writer_publishes_nothing_after_a_stop_that_a_library_caught(tmp_path):
    """Ctrl-C raised in the middle of a library's work (the ONNX exporter, say) may be caught there; the writer
    asks before it publishes, so the user's file stays as it was and the temporary file goes."""
    destination = tmp_path / "model.onnx"
    destination.write_text("old\n")
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_file(str(destination), True) as temporary:
                Path(temporary).write_text("new\n")
                try:
                    record_stop(KeyboardInterrupt())
                    raise KeyboardInterrupt
                except KeyboardInterrupt:
                    pass  # what a library that swallows it does
    finally:
        clear_stops()
    assert destination.read_text() == "old\n" and not leftovers(tmp_path)
    with atomic_file(str(destination), True) as temporary:  # nothing recorded any more: writes go through
        Path(temporary).write_text("new\n")
    assert destination.read_text() == "new\n"


@pytest.mark.parametrize("number, stop", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)],
                         ids=["sigint", "sigterm"])
def test_a_command_that_returns_after_a_caught_signal_ends_as_stopped(number, stop):
    from switchhead import cli

    # as in a terminal (a test run started in the background by a shell has SIGINT ignored)
    before = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL)}
    previous = cli._raise_on_stop_signals()
    try:
        assert set(previous) == {signal.SIGINT, signal.SIGTERM}
        try:
            os.kill(os.getpid(), number)
            time.sleep(1)  # the handler runs in this (the main) thread at the next bytecode
        except KeyboardInterrupt as error:
            assert type(error) is stop  # raised, and caught here as a library would
        with pytest.raises(stop):
            cli._raise_a_swallowed_stop()
    finally:
        for n, handler in previous.items():
            signal.signal(n, handler)
        clear_stops()
        restored = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
        for n, handler in before.items():
            signal.signal(n, handler)
    assert restored == {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
