"""Transformers' own common model tests, fetched at test time for the installed transformers version.

The common test files (`tests/test_modeling_common.py`, `tests/test_configuration_common.py`) ship in the
transformers source distribution on PyPI but not in the wheel. `common_tests_dir()` downloads that sdist with
pip, extracts its `tests/` tree into `~/.cache/switchhead/transformers-tests-<version>/hf_common_tests` and returns
the folder; nothing is written into this repository. Set `SWITCHHEAD_TRANSFORMERS_TESTS` to a folder that
already holds an extracted `tests/` tree to skip the download.

The fetch is safe against concurrent runs and interruptions: one process at a time holds a file lock, the tree is
extracted into a temporary folder next to the cache and moved into place with one atomic rename, so a
half-extracted cache is never seen.

The sdist holds only the top level of `tests/`. Three modules that `test_modeling_common.py` imports live in
sub-folders that are not shipped; where they are missing, `load_common_tests()` installs the stand-ins below:

- `exporters.test_export.ExportTesterMixin`: an empty base class (the torch.export tests are not run).
- `utils.test_configuration_utils.config_common_kwargs`: non-default values of every `PreTrainedConfig` field,
  derived from the installed `PreTrainedConfig` (what `ConfigTester.check_config_arguments_init` sets and reads back).
- `generation.test_utils.GenerationTesterMixin`: the marker base class the common tests check for. Transformers'
  own generation tests cannot be run from the sdist; `tests/conformance/test_transformers_conformance.py` has our
  generation checks instead (they are ours, and counted apart from Transformers' tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers

PACKAGE = "hf_common_tests"  # import name of the extracted tests/ folder (upstream calls it `tests`, as we do)
OVERRIDE_ENV = "SWITCHHEAD_TRANSFORMERS_TESTS"
MISSING_IN_SDIST = ("generation.test_utils", "exporters.test_export", "utils.test_configuration_utils")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "switchhead"


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_sdist(version: str, into: Path) -> Path:
    """`pip download` the transformers source distribution of `version` into `into`; returns the archive path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "--dest", str(into), f"transformers=={version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    archives = sorted(into.glob("transformers-*.tar.gz"))
    if result.returncode != 0 or not archives:
        raise RuntimeError(
            f"could not download the transformers {version} source distribution (needed for Transformers' common "
            f"model tests); `{' '.join(command)}` said:\n{result.stderr[-2000:]}\n"
            f"Give this machine access to PyPI, or set {OVERRIDE_ENV} to an extracted transformers tests/ folder."
        )
    return archives[0]


def _extract_tests(archive: Path, into: Path) -> None:
    """Extract `<top>/tests/**` of the sdist into `into` (a package: every folder gets an __init__.py)."""
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 3 or parts[1] != "tests" or not (member.isfile() or member.isdir()):
                continue
            relative = Path(*parts[2:])
            if ".." in relative.parts:
                raise RuntimeError(f"refusing unsafe path {member.name!r} in {archive}")
            target = into / relative
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
    for folder in [into, *(p for p in into.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch(exist_ok=True)


def common_tests_dir(version: str | None = None) -> Path:
    """The folder holding the `hf_common_tests` package for `version` (default: installed transformers)."""
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        return Path(override)
    version = version or transformers.__version__
    root = cache_root() / f"transformers-tests-{version}"
    if (root / PACKAGE / "test_modeling_common.py").is_file():
        return root
    with _file_lock(cache_root() / f"transformers-tests-{version}.lock"):
        if (root / PACKAGE / "test_modeling_common.py").is_file():  # another process finished while we waited
            return root
        with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".partial-") as work:
            work = Path(work)
            archive = _download_sdist(version, work / "sdist")
            staged = work / "tree"
            _extract_tests(archive, staged / PACKAGE)
            if not (staged / PACKAGE / "test_modeling_common.py").is_file():
                raise RuntimeError(f"{archive.name} has no tests/test_modeling_common.py")
            if root.exists():  # a stale, incomplete tree from an older layout: replace it
                shutil.rmtree(root)
            os.rename(staged, root)  # atomic: the cache is either absent or complete
    return root


# ---------------------------------------------------------------------------------------------- stand-ins
def _config_common_kwargs() -> dict:
    """A non-default value for each common `PreTrainedConfig` field (and the token ids every text config has)."""
    return {
        "return_dict": False,
        "output_hidden_states": True,
        "output_attentions": True,
        "dtype": "float16",
        "chunk_size_feed_forward": 5,
        "architectures": ["SomeModel"],
        "id2label": {0: "label"},
        "label2id": {"label": 0},
        "problem_type": "regression",
        "tie_word_embeddings": True,
        "pad_token_id": 7,
        "bos_token_id": 6,
        "eos_token_id": 8,
    }


class _ExportTesterMixin:
    """Stand-in for tests/exporters/test_export.py (not in the sdist): no export tests."""


class _GenerationTesterMixin:
    """Stand-in marker for tests/generation/test_utils.py (not in the sdist); see the module docstring."""

    switchhead_stand_in = True


def _install_stand_ins(folder: Path) -> list[str]:
    """Register stand-in modules for the sub-modules the sdist lacks; returns the dotted names replaced."""
    contents = {
        "generation.test_utils": {"GenerationTesterMixin": _GenerationTesterMixin},
        "exporters.test_export": {"ExportTesterMixin": _ExportTesterMixin},
        "utils.test_configuration_utils": {"config_common_kwargs": _config_common_kwargs()},
    }
    replaced = []
    for dotted in MISSING_IN_SDIST:
        if (folder / PACKAGE / (dotted.replace(".", "/") + ".py")).is_file():
            continue  # a later sdist may ship it: then Transformers' own module is used
        package_name, module_name = f"{PACKAGE}.{dotted}".rsplit(".", 1)
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = []
            sys.modules[package_name] = package
        module = types.ModuleType(f"{package_name}.{module_name}")
        module.__dict__.update(contents[dotted])
        sys.modules[module.__name__] = module
        replaced.append(dotted)
    return replaced


def load_common_tests() -> tuple[types.ModuleType, types.ModuleType, list[str]]:
    """(test_modeling_common, test_configuration_common, names of stand-in modules) of the installed version."""
    if importlib.util.find_spec("parameterized") is None:
        raise RuntimeError("Transformers' common tests need the `parameterized` package: pip install parameterized")
    folder = common_tests_dir()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    stand_ins = _install_stand_ins(folder)
    modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    return modeling, configuration, stand_ins
