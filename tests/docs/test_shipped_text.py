"""Every tracked text file (code, docs, results, logs) speaks of the project only: no absolute path of the machine that
wrote it (its home, working or temporary folders) and no word of the history of the work that made it (sessions,
leases, "this shared machine", time windows, issue numbers). History goes to CHANGELOG.md, phrased as what changed.

A few uses of these words are legitimate and listed in ALLOWED with the reason: each entry is a path and a regular
expression that the offending text must match, so an allowance covers that one use and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# An absolute path into a machine's home, working, temporary or install folders. Not preceded by a word character, a
# dot or "~" so that relative paths ("runs/tmp/x", "../tmp") and URLs' path parts after a host name do not count.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~$-])/(?:home|root|tmp|work|Users|opt|scratch|mnt)/[\w.-]")

# Words of the work's history, case-insensitive. Each is narrow enough to leave the package's own vocabulary alone
# (a context window, a sliding window, `start_new_session`, a device "of this machine" in an error to the user).
HISTORY = {
    # prose only: not an attribute, a call or an assignment in code (`requests.Session()`, `session.run(...)`)
    "session": re.compile(r"(?<![.\w])sessions?\b(?!\s*[=(.\[])", re.IGNORECASE),
    "lease": re.compile(r"\bleas(?:e|es|ed)\b", re.IGNORECASE),
    "this machine": re.compile(r"\b(?:on this machine|this shared machine)\b", re.IGNORECASE),
    "warm machine": re.compile(r"\bwarm machine\b", re.IGNORECASE),
    "window as time": re.compile(r"\bwindows? took\b|\bsince the (?:first|last|previous) window\b|"
                                 r"\b(?:GPU|device|time) windows?\b", re.IGNORECASE),
    "numbered call": re.compile(r"\bcall [0-9]\b(?![.\d])", re.IGNORECASE),
    "issue number": re.compile(r"(?:^|[\s(\[])#[0-9]{1,4}\b|\bissues? #?[0-9]+\b|\bthe issue's\b", re.IGNORECASE),
}

# (path, what the match sits in, why it is allowed)
ALLOWED = [
    ("tests/docs/test_shipped_text.py", r".*", "this test names the patterns it looks for"),
    ("tests/cli/test_hostile_loading.py", r'"/tmp/outside\.safetensors"',
     "a hostile absolute file name that loading must refuse"),
    ("tests/conftest.py", r'scope="session"', "pytest's fixture scope"),
    ("experiments/run_grid.sh", r"a (?:new )?session (?:of its own|and process group)",
     "setsid: a process session"),
]


def _git_dir() -> Path | None:
    dot_git = REPO / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():  # a worktree: "gitdir: PATH"
        pointer = dot_git.read_text().strip()
        if pointer.startswith("gitdir:"):
            return (REPO / pointer.split(":", 1)[1].strip()).resolve()
    return None


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    """Git's offset encoding of index version 4 (each continuation adds one before shifting)."""
    byte = data[at]
    value, at = byte & 0x7F, at + 1
    while byte & 0x80:
        byte = data[at]
        value, at = ((value + 1) << 7) | (byte & 0x7F), at + 1
    return value, at


def tracked_paths() -> list[str]:
    """The paths in git's index (what `git ls-files` lists), read from the index file itself: versions 2 to 4."""
    git_dir = _git_dir()
    if git_dir is None or not (git_dir / "index").is_file():
        pytest.skip("not a git checkout: the tracked files are what this test reads")
    data = (git_dir / "index").read_bytes()
    assert data[:4] == b"DIRC", "not a git index"
    version, count = int.from_bytes(data[4:8], "big"), int.from_bytes(data[8:12], "big")
    assert version in (2, 3, 4), f"git index version {version}"
    paths, at, previous = [], 12, b""
    for _ in range(count):
        flags = int.from_bytes(data[at + 60:at + 62], "big")
        start = at + 62 + (2 if version >= 3 and flags & 0x4000 else 0)
        if version == 4:
            strip, start = _read_varint(data, start)
            end = data.index(b"\0", start)
            name = previous[:len(previous) - strip] + data[start:end]
            at = end + 1
        else:
            end = data.index(b"\0", start)
            name = data[start:end]
            at = at + ((end - at + 8) // 8) * 8  # entries are NUL-padded to a multiple of 8 bytes
        paths.append(name.decode("utf-8"))
        previous = name
    return paths


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every file git tracks in the checkout that is text (binary files left out: they are not
    read as prose)."""
    files = []
    for name in tracked_paths():
        path = REPO / name
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def _allowed(path: str, line: str, start: int, end: int) -> bool:
    for allowed_path, context, _ in ALLOWED:
        if path != allowed_path:
            continue
        for match in re.finditer(context, line, re.IGNORECASE):
            if match.start() <= start and end <= match.end():
                return True
    return False


def findings(files: list[tuple[str, str]]) -> list[str]:
    """'path:line: what: the text' for each absolute path or history word not in ALLOWED."""
    found = []
    checks = [("absolute path", ABSOLUTE_PATH), *HISTORY.items()]
    for path, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in checks:
                for match in pattern.finditer(line):
                    if not _allowed(path, line, match.start(), match.end()):
                        found.append(f"{path}:{number}: {what}: {line.strip()[:160]}")
    return found


def test_no_tracked_file_carries_a_machine_path_or_a_word_of_the_work_history():
    found = findings(tracked_text_files())
    assert not found, f"{len(found)} finding(s); rephrase, make the path relative, or (if legitimate) add the use " \
                      f"to ALLOWED with its reason:\n" + "\n".join(found[:60])


@pytest.mark.parametrize("text", [
    '  "output_dir": "/work/replication_runs/small/rope-s0",',
    "wrote /tmp/tmp.TjwBOQ0Av3/gpu_check.json",
    "cache in /home/someone/.cache/switchhead",
    "/Users/me/switchhead/runs",
    "# GPU session",
    "which two windows took",
    "open since the first window",
    "about 5 h on one core of this shared machine",
    "2. On the warm machine: rerun e2e_compiled",
    "the stage table is call 1's",
    "as asked in #51",
    "the issue's grid",
    "after the lease ended",
])
def test_the_check_finds_each_kind(text):
    assert findings([("docs/x.md", text)]), text


@pytest.mark.parametrize("text", [
    "python experiments/replicate.py --scale small --out RUNS",
    "--data ../shared/data/wikitext-2",
    "see https://github.com/RobertCsordas/switchhead/tree/main/work/tmp",
    "runs/tmp/checkpoint-10",
    "#!/usr/bin/env bash",
    "ort.InferenceSession(path)",
    "subprocess.Popen(cmd, start_new_session=True)",
    "sliding windows of --context tokens; the first window is scored in full",
    "--device 'tpu:7' is not a device of this machine",
    "needs 12 GiB, more than this machine's 8 GiB of memory",
    "color: #0f0f0f",
    "client = requests.Session()",
    "session = onnxruntime.InferenceSession(path); got = session.run(None, feed)",
    "the test calls 5.23's activation_checkpointing_enable",
    "release 5.24",
    "## Heading",
    "call it with 2 arguments",
])
def test_the_check_leaves_legitimate_text_alone(text):
    found = findings([("docs/x.md", text)])
    assert not found, found


def _script(path: Path, name: str):
    """A script of experiments/ or benchmarks/ as a module (those folders are not packages)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_record_paths_relative_to_the_checkout():
    """machine.portable_path: what a results file records for a path (the authors' kernel file, --out), never an
    absolute folder of the machine that ran the benchmark."""
    portable_path = _script(REPO / "benchmarks" / "machine.py", "machine").portable_path
    assert portable_path(REPO / ".authors" / "cvmm.py") == ".authors/cvmm.py"
    assert portable_path(REPO / "benchmarks" / "results" / "x.json") == "benchmarks/results/x.json"
    assert portable_path(REPO.parent / "shared" / "data") == "../shared/data"
    assert portable_path(Path("/elsewhere/scratch/out.json")) == "out.json"


def test_replication_records_name_no_folder_of_the_machine_that_ran_them(tmp_path):
    """A run record's paths are made portable before a results file holds them: the grid's run folder as RUNS, the
    checkout relative to it, the data beside it as ../, anything else by its name only."""
    replicate = _script(REPO / "experiments" / "replicate.py", "replicate")
    out = tmp_path / "grid"
    record = dict(training_settings=dict(output_dir=str(out / "rope-s0"), tokenizer=str(out / "tokenizer"),
                                         data=str(REPO.parent / "shared" / "data" / "wikitext-2"),
                                         valid_data=None, steps=3),
                  train=dict(output_dir=str(out / "rope-s0") + "/"),
                  files=[str(REPO / "runs" / "x"), "/elsewhere/scratch/file.txt", "relative/kept"])
    assert replicate.portable_paths(record, out) == dict(
        training_settings=dict(output_dir="RUNS/rope-s0", tokenizer="RUNS/tokenizer", data="../shared/data/wikitext-2",
                               valid_data=None, steps=3),
        train=dict(output_dir="RUNS/rope-s0"), files=["runs/x", "file.txt", "relative/kept"])
    assert replicate.portable_paths(str(out), out) == "RUNS"


def test_the_recorded_replication_results_load_under_their_scale():
    """The committed replication results name a scale that experiments/replicate.py still has, and the command
    that regenerates them names the script where it is."""
    import json

    replicate = _script(REPO / "experiments" / "replicate.py", "replicate")
    report = json.loads((REPO / "benchmarks" / "results" / "replication.json").read_text())
    scale = replicate.SCALES[report["scale"]["name"]]
    assert json.loads(json.dumps(replicate.dataclasses.asdict(scale))) == report["scale"]
    assert {run["scale"] for run in report["runs"]} == {scale.name}
    script = report["command"].split()[1]
    assert (REPO / script).is_file(), report["command"]
