"""Shared test setup: offline Hugging Face, deterministic seeds, the path of the read-only shared data."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SWITCHHEAD_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared test data not found at {SHARED_DATA}; set SWITCHHEAD_SHARED_DATA")
    return SHARED_DATA


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long variants (e.g. 20 SIGKILLs); run with `-m slow`, left out by default")
    if not config.option.markexpr:  # the default suite leaves the slow variants out (deselected, not skipped)
        config.option.markexpr = "not slow"
