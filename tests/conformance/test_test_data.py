"""The test data a user can get: one place locates it (scripts/fetch_test_data.py:
$SWITCHHEAD_DATA_DIR, else ../shared/data beside the checkout); without it a run says once what is missing and the
command that gets it, skips the tests that need it and counts them; $SWITCHHEAD_REQUIRE_DATA (CI) makes that an
error; the script fetches the files and checks them against the manifest."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from helpers.data import fetch_test_data, require

ROOT = Path(__file__).resolve().parents[2]
# two tests that need the data (one through the shared_data fixture, one through the module fixture of
# helpers/runs.py's kind) and one that does not
NEED_DATA = ["tests/training/test_training.py::test_gpt2_tokenizer_folder_loads_with_its_end_of_text_token",
             "tests/training/test_reliability.py::test_training_config_rejects_unknown_model_fields_with_a_suggestion"]
NO_DATA = "tests/training/test_training.py::test_presets_carry_the_paper_training_settings"


def _pytest(data: Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != fetch_test_data.REQUIRE_ENV}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SWITCHHEAD_DATA_DIR=str(data), **extra_env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *NEED_DATA, NO_DATA],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_without_the_data_the_run_says_what_is_missing_first_and_skips_what_needs_it(tmp_path):
    empty = tmp_path / "no-data"
    empty.mkdir()
    result = _pytest(empty)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-2000:]
    first = out.splitlines()[0]  # before any test ran
    assert first.startswith(f"test data missing in {empty} (SWITCHHEAD_DATA_DIR={empty}): ")
    for part in ("wikitext-2 (3 of 3 files)", "blimp (67 of 67 files)", "tokenizers/gpt2 (2 of 2 files)",
                 "`python scripts/fetch_test_data.py`", "The tests that need it are skipped."):
        assert part in first
    assert out.count("test data missing in ") == 2  # the start, and the count at the end
    assert "2 tests skipped for want of data: test data missing in" in out
    assert "1 passed, 2 skipped" in out.splitlines()[-1]  # pytest's own summary line counts them
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 2 and all("test data missing: " in line and "fetch_test_data.py" in line for line in skips)
    assert "FileNotFoundError" not in out and "error" not in out.splitlines()[-1]


@pytest.mark.integration
def test_tests_that_read_their_own_sub_run_pass_without_the_data(tmp_path):
    """A test that runs pytest in a child reads the child's counts, not its banners: without the data the run's
    first line says "skipped", which must not fail a test that needs no data (the Triton interpreter suite)."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key != fetch_test_data.REQUIRE_ENV}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SWITCHHEAD_DATA_DIR=str(empty))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/kernels/test_kernels.py::test_triton_kernels_under_interpreter"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = result.stdout
    assert out.splitlines()[0].startswith("test data missing in "), out[-3000:]
    assert result.returncode == 0 and "1 passed" in out.splitlines()[-1], out[-3000:] + result.stderr[-2000:]


@pytest.mark.integration
def test_ci_fails_at_the_start_instead_of_skipping(tmp_path):
    result = _pytest(tmp_path, SWITCHHEAD_REQUIRE_DATA="1")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout[-2000:] + result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert f"test data missing in {tmp_path}" in said and "python scripts/fetch_test_data.py" in said
    assert "SWITCHHEAD_REQUIRE_DATA is set (CI)" in said
    assert "no tests ran" in result.stdout and "passed" not in said  # it stopped before the first test


def test_a_partial_folder_names_only_what_it_lacks(tmp_path, monkeypatch):
    (tmp_path / "tokenizers" / "gpt2").mkdir(parents=True)
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / "tokenizers" / "gpt2" / name).write_text("{}")
    monkeypatch.setenv("SWITCHHEAD_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("SWITCHHEAD_REQUIRE_DATA", raising=False)
    assert require("tokenizers/gpt2") == tmp_path  # what it has is enough for a test that needs only that
    with pytest.raises(pytest.skip.Exception, match=r"test data missing: wikitext-2 \(3 of 3 files\) \(get it"):
        require("tokenizers/gpt2", "wikitext-2")


def test_the_manifest_in_the_repository_is_the_data_folders():
    data = require()
    assert (ROOT / "scripts" / "test_data.sha256").read_text() == (data / "MANIFEST.sha256").read_text()


# ------------------------------------------------------------------------------ the fetch script, served locally
def _porch_archive(train_text: str) -> bytes:
    """An archive in Porch's layout (token ids of each line, `<eos>` ending it; the vocabulary one word a line)."""
    vocabulary, ids = {"<eos>": 0}, []
    for line in train_text.split("\n")[:-1]:
        words = line.strip(" ").split(" ") if line.strip(" ") else []  # " w1 w2 ... ": single spaces only
        ids += [vocabulary.setdefault(word, len(vocabulary)) for word in words] + [0]
    buffer = io.BytesIO()
    np.save(buffer, np.array(ids, dtype="<i8"))
    members = {"wikitext-2/train.npy": buffer.getvalue(), "wikitext-2/type.info": "\n".join(vocabulary).encode()}
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return archive.getvalue()


@pytest.fixture
def served(tmp_path):
    """The data's files laid out as raw.githubusercontent.com serves them at the pinned commits, on loopback."""
    data = require()
    tree = tmp_path / "raw"
    for name in fetch_test_data.manifest():
        repository, commit, path = fetch_test_data.source_of(name)
        target = tree / repository / commit / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == fetch_test_data.REBUILT:
            target.write_bytes(_porch_archive((data / name).read_text(encoding="utf-8")))
        else:
            shutil.copyfile(data / name, target)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tree))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tree, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.integration
def test_fetch_gets_every_file_checks_it_and_writes_nothing_that_does_not_match(served, tmp_path, monkeypatch,
                                                                               capsys):
    tree, base = served
    archive = tree / "/".join(fetch_test_data.PORCH)
    monkeypatch.setattr(fetch_test_data, "PORCH_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    spoiled = "blimp/causative.jsonl"
    served_copy = tree / "/".join(fetch_test_data.source_of(spoiled))
    served_copy.write_bytes(served_copy.read_bytes().replace(b"a", b"b", 1))  # one byte differs upstream
    dest = tmp_path / "data"

    assert fetch_test_data.main(["--dest", str(dest), "--base-url", base]) == 1
    out, err = capsys.readouterr()
    assert f"{spoiled}: the downloaded file's SHA-256 is not the manifest's; nothing written" in err
    assert not (dest / spoiled).exists() and not list(dest.rglob("*.part"))
    assert "76 of 77 files present and verified (76 fetched, 0 already there); 1 not" in out
    # the rebuilt training split is the published file byte for byte
    assert (dest / fetch_test_data.REBUILT).read_bytes() == (require() / fetch_test_data.REBUILT).read_bytes()

    shutil.copyfile(require() / spoiled, served_copy)  # upstream fixed: only the missing file is fetched
    assert fetch_test_data.main(["--dest", str(dest), "--base-url", base]) == 0
    assert "77 of 77 files present and verified (1 fetched, 76 already there)" in capsys.readouterr().out
    assert fetch_test_data.main(["--dest", str(dest), "--check"]) == 0
    assert (dest / "MANIFEST.sha256").read_bytes() == (ROOT / "scripts" / "test_data.sha256").read_bytes()

    (dest / "lambada" / "lambada_test.jsonl").write_text("changed\n")  # a damaged copy is named by --check
    assert fetch_test_data.main(["--dest", str(dest), "--check"]) == 1
    assert "lambada/lambada_test.jsonl: wrong SHA-256" in capsys.readouterr().err


def test_fetch_without_a_connection_tries_once_and_says_what_to_do(tmp_path, capsys):
    dest = tmp_path / "data"
    assert fetch_test_data.main(["--dest", str(dest), "--base-url", "http://127.0.0.1:9"]) == 1  # nothing listens
    out, err = capsys.readouterr()
    assert err.count("cannot download") == 1 and "no connection, so nothing more was tried" in err
    assert "copy the files listed in scripts/test_data.sha256" in err
    assert "0 of 77 files present and verified" in out and not dest.exists()
