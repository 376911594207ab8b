"""The test data (WikiText, LAMBADA, BLiMP, C4, two tokenizers), located in one place: scripts/fetch_test_data.py
($SWITCHHEAD_DATA_DIR, else ../shared/data beside the checkout), whose manifest lists every file.

A test that needs data asks `require("wikitext-2")` (or the `shared_data` fixture, for all of it): it gets the
folder, or, where those files are missing, is skipped with one reason that names what is missing and the command
that gets it. conftest.py says the same once at the start of the run and counts the skips at the end; with
$SWITCHHEAD_REQUIRE_DATA set (CI) missing data fails the run at its start instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_test_data.py"
_spec = importlib.util.spec_from_file_location("switchhead_fetch_test_data", _SCRIPT)
fetch_test_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_test_data)

DATA_ENV = fetch_test_data.DATA_ENV
REQUIRE_ENV = fetch_test_data.REQUIRE_ENV
COMMAND = fetch_test_data.COMMAND
SKIP_TAG = "test data missing"  # begins every skip reason: conftest counts the skips by it


def data_dir() -> Path:
    return fetch_test_data.data_dir()


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing(*parts: str) -> list[str]:
    """The manifest's files under the folders `parts` (all when none is named) that the data folder lacks."""
    return fetch_test_data.missing(data_dir(), *parts)


def describe(names: list[str]) -> str:
    """`wikitext-2 (3 of 3 files), blimp (67 of 67 files)`: what is missing, by folder."""
    total = Counter(_folder(name) for name in fetch_test_data.manifest())
    absent = Counter(_folder(name) for name in names)
    return ", ".join(f"{folder} ({count} of {total[folder]} files)" for folder, count in absent.items())


def _folder(name: str) -> str:
    return name.rsplit("/", 1)[0] if name.startswith("tokenizers/") else name.split("/")[0]


def message(names: list[str]) -> str:
    """The one message of a run without (some of) the data."""
    where = os.environ.get(DATA_ENV)
    located = f"{DATA_ENV}={where}" if where else f"../shared/data beside the checkout; set {DATA_ENV} to use another"
    return (f"{SKIP_TAG} in {data_dir()} ({located}): {describe(names)}. Get it with `{COMMAND}` (downloads the "
            f"files from their public sources and checks them against scripts/test_data.sha256)")


def skip_reason(names: list[str]) -> str:
    return f"{SKIP_TAG}: {describe(names)} (get it with `{COMMAND}`)"


def require(*parts: str) -> Path:
    """The data folder, when it holds every file under `parts` (all files when none is named); else the calling
    test is skipped (failed under $SWITCHHEAD_REQUIRE_DATA)."""
    absent = missing(*parts)
    if absent:
        if required():
            pytest.fail(f"{message(absent)}. {REQUIRE_ENV} is set, so that is an error", pytrace=False)
        pytest.skip(skip_reason(absent))
    return data_dir()

