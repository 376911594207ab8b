"""Shared test setup: offline Hugging Face, deterministic seeds, the read-only test data (helpers/data.py: where it
is, and what a run without it does)."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import data as test_data  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = test_data.data_dir()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """In the fast tier (`-m "not integration"`), a test that starts a process fails and says to mark it: the tier
    stays fast because nothing in it can start a Python, a server, a compiler or a launcher unnoticed."""
    if "not integration" not in (request.config.option.markexpr or "") or request.node.get_closest_marker(
            "integration"):
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The test data folder with every file of the manifest (else the test is skipped: helpers/data.py)."""
    return test_data.require()


def pytest_configure(config):
    config.addinivalue_line("markers", "compat: the compatibility subset run under every Transformers release "
                                       "(COMPAT_SUBSET; scripts/test.sh)")
    config.addinivalue_line("markers", "slow: long variants (e.g. 20 SIGKILLs); run with `-m slow`, left out by default")
    config.addinivalue_line("markers", "integration: starts processes, trains, compiles with inductor, builds docs or "
                                       "environments; in the default run, left out of the fast tier "
                                       "(`pytest -m \"not integration\"`)")
    if not config.option.markexpr:  # the default suite leaves the slow variants out (deselected, not skipped)
        config.option.markexpr = "not slow"


# What a Transformers release change breaks: the tests `scripts/test.sh` runs again under every release of its
# compatibility matrix, as `pytest -m compat`. An entry is a file, or a file and a test (all its parameters).
COMPAT_SUBSET = (
    "conformance/test_compat.py",  # the compatibility layer; each decoding step sees the whole cache, every variant
    "model/test_modeling.py::test_cached_decoding_equals_uncached_and_full_forward",  # every variant, left padding
    "model/test_modeling.py::test_save_and_reload_gives_identical_logits",
    "model/test_modeling.py::test_saved_folder_loads_with_trust_remote_code_without_the_package",
    "conformance/test_clean_env.py",  # trust_remote_code in a fresh environment with only torch, transformers, safetensors
    "model/test_static_cache.py::test_static_cache_generation_equals_dynamic_cache",
    "model/test_static_cache.py::test_static_cache_logits_equal_the_full_forward_with_left_padding",
    "serving/test_continuous_batching.py::test_generate_batch_equals_generate",
    "serving/test_continuous_batching.py::test_requests_arriving_while_others_decode",
    "serving/test_continuous_batching.py::test_xl_eager_paged",
    "model/test_rope_scaling.py::test_cos_sin_match_transformers_rotary_for_every_type",
    "model/test_rope_scaling.py::test_yarn_factor_4_at_three_times_the_context_greedy_cache_matches_full_forward",
    "training/test_trainer.py::test_trainer_with_gradient_accumulation_lowers_loss_and_reloads",
    "training/test_peft.py::test_lora_everywhere_trains_saves_adapter_only_reloads_and_merges",
    "serving/test_serving.py::test_completions_and_chat_equal_generate",  # `switchhead serve` in a subprocess
    "serving/test_serving.py::test_serve_refuses_a_transformers_server_it_does_not_wrap",  # or refuses it
    "conformance/test_transformers_conformance.py",  # Transformers' own common tests of the release, and their summary
    "model/test_task_heads.py::test_causal_lm_folder_loads_as_task_model_with_a_new_head",  # the generic heads
    "model/test_task_heads.py::test_task_heads_load_with_trust_remote_code_without_the_package",
    "model/test_renamed_parameters.py",  # the checkpoint conversion mapping of the renamed sigma-MoE tensors
    "conversion/test_export.py::test_torch_export_with_dynamic_batch_and_sequence_equals_eager_at_every_shape",
    "training/test_peft.py::test_stock_peft_with_lora_targets_adapts_every_expert_saves_reloads_and_merges",
)


def _compat_entry(nodeid: str) -> str | None:
    """The COMPAT_SUBSET entry a collected test belongs to, or None."""
    relative = nodeid.split("tests/", 1)[-1]
    for entry in COMPAT_SUBSET:
        if relative == entry or relative.startswith((entry + "::", entry + "[")):
            return entry
    return None


def pytest_collection_modifyitems(config, items):
    _say_what_data_is_missing(config)
    matched = set()
    for item in items:
        if item.get_closest_marker("slow"):  # a long variant is never part of the fast tier
            item.add_marker(pytest.mark.integration)
        entry = _compat_entry(item.nodeid)
        if entry is not None:
            item.add_marker(pytest.mark.compat)
            matched.add(entry)
    # a renamed or removed test must not silently leave the matrix: when the whole suite is collected, every
    # entry has to match something
    whole_suite = {Path(str(arg)).name for arg in config.args} == {"tests"}
    missing = [entry for entry in COMPAT_SUBSET if entry not in matched]
    if whole_suite and missing:
        raise pytest.UsageError(f"COMPAT_SUBSET entries match no test (renamed?): {', '.join(missing)}")


# ------------------------------------------------------------------------------------------- without the test data
def _say_what_data_is_missing(config) -> None:
    """Once, before any test runs: what is missing and the command that gets it; under $SWITCHHEAD_REQUIRE_DATA (CI)
    the run stops here instead, so that no test can be skipped for want of data."""
    absent = test_data.missing()
    if not absent:
        return
    if test_data.required():
        raise pytest.UsageError(f"{test_data.message(absent)}. {test_data.REQUIRE_ENV} is set (CI): every test must "
                                f"run, none may be skipped for want of data")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{test_data.message(absent)}. The tests that need it are skipped.", yellow=True,
                            bold=True)


_data_skips = 0


def pytest_runtest_logreport(report):
    global _data_skips
    if report.skipped and isinstance(report.longrepr, tuple) and test_data.SKIP_TAG in str(report.longrepr[2]):
        _data_skips += 1


def pytest_terminal_summary(terminalreporter):
    if _data_skips:
        terminalreporter.write_line(f"{_data_skips} test{'s' * (_data_skips != 1)} skipped for want of data: "
                                    f"{test_data.message(test_data.missing())}", yellow=True, bold=True)
