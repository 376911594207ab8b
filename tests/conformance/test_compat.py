"""The compatibility layer (`switchhead.transformers_compat`): the same model behaviour on every supported release.

These tests run on the pinned release with the whole suite, and again, with the rest of the compatibility subset
(`pytest -m compat`, listed in conftest.py), under each release of `scripts/test.sh`'s matrix.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.cache_utils import Cache, DynamicCache

from helpers.padding import left_padded_batch, positions_from_mask
from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead import transformers_compat as compat

PACKAGE = Path(__file__).resolve().parents[2] / "modeling_switchhead"
VARIANTS = ["tiny-switchhead", "tiny-switchhead-xl", "tiny-switchall", "tiny-dense", "tiny-dense-xl"]


def _model(preset: str) -> SwitchHeadForCausalLM:
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset)).eval()


def test_the_release_under_test_is_in_the_supported_range():
    print(f"\ntransformers {transformers.__version__}: the cache is called {compat.CACHE_NAME!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_transformers_version()
    newer = Version(transformers.__version__).release[:2] > Version(compat.NEWEST_TESTED).release[:2]
    # the matrix's newest release may be beyond NEWEST_TESTED: then, and only then, it warns
    assert [w for w in caught if compat.NEWEST_TESTED in str(w.message)] if newer else not caught


@pytest.mark.parametrize("version", ["5.16.1", "5.25.0", "5.25.0.dev0", "6.0.0"])
def test_a_release_outside_the_tested_range_warns_naming_it(version):
    with pytest.warns(UserWarning, match=rf"tested with transformers 5\.17\.0 to {compat.NEWEST_TESTED}, and "
                                         rf"transformers {re.escape(version)} is installed.*pip install "
                                         rf"'transformers>=5\.17,<5\.25'"):
        compat.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.17.0", "5.19.0", "5.23.0", "5.24.0", "5.24.3"])
def test_a_supported_release_is_silent(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_transformers_version(version)


def test_a_release_without_what_the_model_imports_raises_with_the_fix(monkeypatch):
    """As on transformers 5.0, which has no `merge_with_config_defaults`: importing the model file (here a fresh
    copy of it, as remote code would load it) raises one ImportError naming the releases to install."""
    import transformers.utils.generic as generic

    monkeypatch.delattr(generic, "merge_with_config_defaults")
    package = types.ModuleType("switchhead_fresh_copy")
    package.__path__ = [str(PACKAGE)]
    monkeypatch.setitem(sys.modules, "switchhead_fresh_copy", package)
    try:
        with pytest.raises(ImportError, match=r"lacks what SwitchHead models use .*merge_with_config_defaults.*"
                                              r"pip install 'transformers>=5\.17,<5\.25'"):
            importlib.import_module("switchhead_fresh_copy.modeling_switchhead")
    finally:
        for name in [name for name in sys.modules if name.startswith("switchhead_fresh_copy.")]:
            del sys.modules[name]


def test_setup_declares_exactly_the_supported_range():
    setup = (PACKAGE.parent / "setup.py").read_text()
    assert f'"transformers{compat.SUPPORTED_RANGE}"' in setup
    oldest, newest = compat.OLDEST_SUPPORTED.split("."), compat.NEWEST_TESTED.split(".")
    assert compat.SUPPORTED_RANGE == f">={oldest[0]}.{oldest[1]},<{newest[0]}.{int(newest[1]) + 1}"


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchhead-xl"])
def test_the_cache_is_taken_under_either_name_and_continues_exactly(preset):
    model = _model(preset)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        for name in ("cache", "past_key_values"):
            prefix = 4
            out = model(ids[:, :prefix], attention_mask=mask[:, :prefix],
                        position_ids=positions_from_mask(mask)[:, :prefix], use_cache=True)
            cache = compat.output_cache(out)
            assert isinstance(cache, Cache) and cache.get_seq_length() == prefix
            rest = model(ids[:, prefix:], attention_mask=mask, position_ids=positions_from_mask(mask)[:, prefix:],
                         use_cache=True, **{name: cache})
            assert compat.output_cache(rest) is cache and cache.get_seq_length() == ids.shape[1]
            torch.testing.assert_close(rest.logits, full[:, prefix:], atol=1e-5, rtol=0)


def test_two_different_caches_under_both_names_are_refused():
    model = _model("tiny-switchhead")
    ids = torch.randint(1, model.config.vocab_size, (1, 3))
    with pytest.raises(ValueError) as error:
        model(ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    assert "`cache`" in str(error.value) and "`past_key_values`" in str(error.value)


def test_the_old_name_is_deprecated_only_where_the_release_renamed_it():
    model = _model("tiny-switchhead")
    ids = torch.randint(1, model.config.vocab_size, (1, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    deprecated = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
    assert bool(deprecated) == (compat.CACHE_NAME == "cache")


def test_outputs_carry_the_cache_under_the_release_name():
    model = _model("tiny-switchall")
    ids = torch.randint(1, model.config.vocab_size, (2, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert isinstance(out[compat.CACHE_NAME], Cache)
    assert compat.CACHE_NAME in out.keys()  # a real field of the installed release's output class
    assert model.config.keys_to_ignore_at_inference == ["cache", "past_key_values"]  # Trainer's evaluation drops it


@pytest.mark.parametrize("preset", VARIANTS)
def test_generate_decodes_each_step_against_the_whole_cache(preset, monkeypatch):
    """What broke on 5.24: generate passed its cache under a name the model did not read, so every step after the
    first attended to its own token alone. Each decoding step must see a cache holding every earlier token."""
    model = _model(preset)
    ids, mask = left_padded_batch(model.config.vocab_size)
    seen = []
    forward = type(model.model).forward

    def spy(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append((kwargs["input_ids"].shape[1], compat.output_cache(out).get_seq_length()))
        return out

    monkeypatch.setattr(type(model.model), "forward", spy)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    width = ids.shape[1]
    assert seen == [(width, width)] + [(1, width + step) for step in range(1, 4)]


# ------------------------------------------------------------------------------------------ the matrix script
def _matrix():
    sys.path.insert(0, str(PACKAGE.parent / "scripts"))
    try:
        return importlib.import_module("compat_matrix")
    finally:
        sys.path.pop(0)


def test_matrix_reads_pytest_summaries_and_the_supported_range():
    matrix = _matrix()
    assert matrix.compat_constant("OLDEST_SUPPORTED") == compat.OLDEST_SUPPORTED
    assert matrix.summary_counts("....\n9 failed, 486 passed, 238 skipped, 670 deselected, 23 warnings, 2804 "
                                 "subtests passed in 402.71s (0:06:42)\n") == {
        "passed": 486, "failed": 9, "errors": 0, "skipped": 238}
    assert matrix.summary_counts("===== 2 passed, 1 error in 3.10s =====") == {
        "passed": 2, "failed": 0, "errors": 1, "skipped": 0}
    assert matrix.summary_counts("collected 3 items\nKeyboardInterrupt\n") is None  # an unfinished run


@pytest.mark.parametrize("log, code", [("24 passed, 1 skipped in 3.0s\n", 0), ("1 failed, 23 passed in 3.0s\n", 1),
                                       ("interrupted\n", 1)])
def test_matrix_prints_one_line_per_release_and_fails_with_the_main_run(log, code, tmp_path, capsys):
    matrix = _matrix()
    main_log = tmp_path / "main.log"
    main_log.write_text(log)
    # only the pinned release asked for: nothing to build, the main run's line and status remain
    assert matrix.main(["--main-log", str(main_log), "--releases", transformers.__version__]) == code
    out = capsys.readouterr().out
    assert f"transformers {transformers.__version__} (pinned): whole suite: " in out
    assert ("24 passed, 0 failed, 0 errors, 1 skipped" in out) if code == 0 else True


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchhead-xl", "tiny-dense"])
def test_the_attention_layer_takes_the_cache_by_its_one_name(preset):
    """Inside the model the cache is `cache=` on every release: each step attends to every cached token; the old
    name, which only the top-level forwards accept, is refused by a layer (in **kwargs it would be ignored)."""
    model = _model(preset)
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)[None]
    rotary = model.model.rotary_emb
    embeddings = (lambda t: rotary(hidden[:, t], positions[:, t])) if rotary is not None else (lambda t: None)
    with torch.no_grad():
        full, _ = attention(hidden, embeddings(slice(0, 6)), None)
        cache = DynamicCache(config=model.config)
        attention(hidden[:, :4], embeddings(slice(0, 4)), None, cache=cache)
        steps = [attention(hidden[:, t:t + 1], embeddings(slice(t, t + 1)), None, cache=cache)[0] for t in (4, 5)]
        assert cache.get_seq_length() == 6  # every step went into the cache
        with pytest.raises(TypeError, match="cache="):
            attention(hidden[:, 5:], embeddings(slice(5, 6)), None, past_key_values=cache)
        with pytest.raises(TypeError, match="cache="):
            model.model.layers[0](hidden[:, 5:], embeddings(slice(5, 6)), None, past_key_values=cache)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 4:], atol=1e-5, rtol=0)


def test_matrix_tells_a_release_the_registry_cannot_install_from_a_broken_build(tmp_path, monkeypatch):
    """pip's "no matching distribution" for a requirement the registry lacks is NotInstallable, and the half-built
    environment goes; any other failure to install is a plain error (it fails the run)."""
    matrix = _matrix()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(matrix, "create_env", lambda root, dirs: root.mkdir(parents=True) or root / "bin" / "python")
    stderr = {"gap": "WARNING: Location 'file:///x/simple/kernels/' is ignored: it is neither a file nor a directory.\n"
                     "ERROR: Could not find a version that satisfies the requirement kernels<0.20,>=0.19.1 (from "
                     "transformers) (from versions: 0.17.2)\nERROR: No matching distribution found for "
                     "kernels<0.20,>=0.19.1\n",
              "disk": "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"}
    for case, text in stderr.items():
        monkeypatch.setattr(matrix, "run", lambda command, text=text: subprocess.CompletedProcess(command, 1, "", text))
        with pytest.raises(RuntimeError) as caught:
            matrix.build_env("5.99.0", True)
        assert isinstance(caught.value, matrix.NotInstallable) == (case == "gap")
        if case == "gap":
            assert str(caught.value) == ("Could not find a version that satisfies the requirement kernels<0.20,>=0.19.1"
                                         " (from transformers) (from versions: 0.17.2); No matching distribution "
                                         "found for kernels<0.20,>=0.19.1")
            assert not any(tmp_path.joinpath("switchhead").iterdir())  # nothing half-built is left to be reused
    assert matrix.newer_than(["5.99.0", "5.98.0rc1", "5.98.0", transformers.__version__, "5.0.0"],
                             transformers.__version__) == ["5.99.0", "5.98.0"]


@pytest.mark.parametrize("failure", ["registry gap", "every release", "broken build"])
def test_matrix_tests_the_newest_release_that_installs(failure, tmp_path, monkeypatch, capsys):
    """The newest release on the registry that cannot install (its new dependency not mirrored yet) is passed
    over, saying why, for the next newest; a build that breaks otherwise fails the run."""
    matrix = _matrix()
    monkeypatch.setattr(matrix, "registry_releases", lambda package: ["5.99.0", "5.98.0", "5.97.0",
                                                                       transformers.__version__, "5.0.0"])
    tried = []

    def build_env(release, newest):
        tried.append(release)
        if failure == "broken build" and release == "5.98.0":
            raise RuntimeError("pip install failed: [Errno 28] No space left on device")
        if release == "5.99.0" or failure == "every release":
            raise matrix.NotInstallable("No matching distribution found for kernels<0.20,>=0.19.1")
        return tmp_path / "python"

    monkeypatch.setattr(matrix, "build_env", build_env)
    code = matrix.main(["--releases", "newest", "--prepare"])
    out = capsys.readouterr().out
    assert "5.99.0 is on the registry but does not install here: No matching distribution found for kernels" in out
    if failure == "registry gap":
        assert (code, tried) == (0, ["5.99.0", "5.98.0"])
        assert "the transformers 5.98.0 environment is ready" in out
    elif failure == "every release":
        assert (code, tried) == (0, ["5.99.0", "5.98.0", "5.97.0"])  # never below the pinned release
        assert "environment is ready" not in out
        assert matrix.main(["--releases", "newest"]) == 0  # the test run's summary says none installs
        assert "none of the 3 releases tried installs from the registry" in capsys.readouterr().out
    else:
        assert (code, tried) == (1, ["5.99.0", "5.98.0"])
        assert "No space left on device" in out
