"""The vLLM plugin (switchhead.vllm) is exact: greedy tokens from vLLM equal `generate()`, log-probabilities agree.

Runs in the vLLM environment (`bash scripts/vllm.sh` builds .venv-vllm; `scripts/test.sh` runs this file there);
skipped where vLLM is not installed. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor) and one engine at a time: each case saves a checkpoint, loads it with `LLM(model=folder)` (no flags: the
plugin's entry point picks `switchhead.vllm`), generates, and shuts the engine down.

Every case: 16 prompts of 1 to 90 tokens (six share a 64-token prefix) x 32 new greedy tokens, fp32, with
continuous batching (at most 6 sequences and 64 tokens a step, so long prompts are prefilled in chunks beside
other requests' decoding and requests join as others finish) and prefix caching (32-token blocks; some requests
must reuse cached blocks). The tokens must equal `generate()`'s for each prompt alone, and vLLM's top-5
log-probabilities those of generate()'s logits within 1e-4.
"""

from __future__ import annotations

import gc
import json
import os
import time

import pytest

# before vLLM is imported: in-process engine, a small CPU KV cache, no thread pinning on a shared machine
for _name, _value in dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                          VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1").items():
    os.environ.setdefault(_name, _value)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test.sh runs this file in .venv-vllm "
                                          "(bash scripts/vllm.sh)")

import torch  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402

NEW_TOKENS = 32
TOP_LOGPROBS = 5
TOLERANCE = 1e-4
ENGINE = dict(dtype="float32", max_model_len=128, block_size=32, enable_prefix_caching=True, max_num_seqs=6,
              max_num_batched_tokens=64, seed=0, distributed_executor_backend="uni", skip_tokenizer_init=True,
              enforce_eager=True)


def _longrope(pairs: int) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128, "factor": 2.0,
            "short_factor": [1.0 + 0.1 * i for i in range(pairs)], "long_factor": [2.0 + 0.5 * i for i in range(pairs)]}


# name -> (preset, overrides): every variant the plugin serves, and the options the config accepts, on tiny models
CASES = {
    "switchhead-rope": ("tiny-switchhead", {}),
    "switchall-rope": ("tiny-switchall", {}),
    "dense-rope": ("tiny-dense", {}),
    "switchhead-xl": ("tiny-switchhead-xl", {}),
    "dense-xl": ("tiny-dense-xl", {}),
    # XL with an odd width (the last frequency has a sin channel only), sigma-MoE, GELU
    "switchall-xl-odd-width": ("tiny-switchall", dict(position_encoding="xl", hidden_size=63, hidden_act="gelu")),
    # the scaled RoPE types, each beside another option: expert values only, tied embeddings
    "linear-rope-value-experts": ("tiny-switchhead", dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        attention_expert_projections="value", tie_word_embeddings=True)),
    # expert outputs only, SiLU, a quarter of the channels rotated, head_dim 32 (no padding)
    "yarn-rope-output-experts": ("tiny-switchhead", dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 32},
        attention_expert_projections="output", hidden_act="silu", partial_rotary_factor=0.25, head_dim=32)),
    # the dense baseline with the output gate
    "llama3-rope-gated-dense": ("tiny-dense", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "rope_theta": 500000.0, "original_max_position_embeddings": 32},
        attention_output_gate=True)),
    "dynamic-rope-switchall": ("tiny-switchall", dict(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "longrope-switchhead": ("tiny-switchhead", dict(head_dim=32, max_position_embeddings=256,
                                                    rope_parameters=_longrope(8))),
}
# the paper-size presets (random weights, 8000 tokens): the 45M RoPE model (head_dim 64) and the 47M XL one
# (head_dim 76, folded to 488 channels, padded to 512)
LARGE_CASES = {"wt103-45m-switchhead-rope": ("wt103-45m-switchhead-rope", {}),
               "c4-47m-switchhead-xl": ("c4-47m-switchhead-xl", {})}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts: six with one 64-token prefix (tails of 1 to 20 tokens), ten of 1 to 90 tokens."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    prefix = tokens(64)
    shared = [prefix + tokens(n) for n in (20, 1, 7, 13, 3, 16)]
    alone = [tokens(n) for n in (1, 2, 5, 9, 14, 23, 37, 50, 71, 90)]
    return [shared[0], *alone[:5], *shared[1:], *alone[5:]]


def _save(folder, preset: str, overrides: dict) -> SwitchHeadConfig:
    config = SwitchHeadConfig.from_preset(preset, **overrides)
    torch.manual_seed(0)
    SwitchHeadForCausalLM(config).eval().save_pretrained(folder)
    return config


def _reference(folder, prompts):
    """generate() per prompt (no padding): the new tokens and each step's log-probabilities `[32, vocab]`."""
    model = SwitchHeadForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # the mask given: generate() would otherwise take every pad_token_id in the prompt for padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            logprobs = torch.log_softmax(torch.cat(out.logits).double(), dim=-1)
            results.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    return results


def close(llm) -> None:
    """Shut an in-process engine down so that the next LLM starts clean."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _generate(llm, prompts):
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS, ignore_eos=True,
                                 detokenize=False)
    return llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)


def compare(name: str, folder, config: SwitchHeadConfig) -> dict:
    """Run one checkpoint through vLLM and generate(); return the agreement numbers."""
    prompts = _prompts(config.vocab_size)
    started = time.perf_counter()
    llm = vllm.LLM(model=str(folder), **ENGINE)
    try:
        outputs = _generate(llm, prompts)
        again = _generate(llm, prompts[:4])  # the same prompts once more: served from the prefix cache
    finally:
        close(llm)
    vllm_seconds = time.perf_counter() - started
    reference = _reference(folder, prompts)
    equal, worst, mismatches = 0, 0.0, []
    for index, (output, (want, logprobs)) in enumerate(zip(outputs, reference)):
        got = list(output.outputs[0].token_ids)
        if got == want:
            equal += 1
        else:
            mismatches.append((index, len(prompts[index]), got, want))
        steps = min(len(got), len(want))
        for step in range(steps):
            if got[:step] != want[:step]:
                break  # after a divergence the contexts differ
            # vLLM's top-5 (and the chosen token) against generate()'s log-probabilities of the same tokens; the
            # top-5 must be the reference's up to near-ties (flat distributions of random tiny models)
            given = output.outputs[0].logprobs[step]
            for token, logprob in given.items():
                worst = max(worst, abs(logprob.logprob - logprobs[step, token].item()))
            fifth = logprobs[step].topk(TOP_LOGPROBS).values[-1].item()
            top = [lp.logprob for lp in given.values() if lp.rank is not None and lp.rank <= TOP_LOGPROBS]
            assert len(top) >= TOP_LOGPROBS and min(top) >= fifth - TOLERANCE, (name, index, step)
    cached = sum(output.num_cached_tokens or 0 for output in [*outputs, *again])
    repeat_equal = all(list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                       for a, b in zip(again, outputs[:4]))
    return dict(case=name, prompts=len(prompts), equal=equal, max_logprob_diff=worst, cached_tokens=cached,
                repeat_equal=repeat_equal, mismatches=mismatches, vllm_seconds=round(vllm_seconds, 1))


def _check(result: dict, capsys) -> None:
    with capsys.disabled():  # one line per case in the log: what agreed, how closely
        print(f"\nvllm exactness {result['case']}: {result['equal']}/{result['prompts']} prompts x {NEW_TOKENS} "
              f"tokens equal to generate(), max |logprob diff| {result['max_logprob_diff']:.2e}, "
              f"{result['cached_tokens']} prompt tokens from the prefix cache, vLLM {result['vllm_seconds']} s")
        if os.environ.get("SWITCHHEAD_VLLM_RESULTS"):
            with open(os.environ["SWITCHHEAD_VLLM_RESULTS"], "a") as log:
                log.write(json.dumps({k: v for k, v in result.items() if k != "mismatches"}) + "\n")
    assert not result["mismatches"], result["mismatches"][:2]
    assert result["equal"] == result["prompts"]
    assert result["max_logprob_diff"] <= TOLERANCE
    assert result["cached_tokens"] > 0, "no request reused the prefix cache"
    assert result["repeat_equal"]


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_greedy_tokens_and_logprobs_equal_generate(name, tmp_path, capsys):
    preset, overrides = CASES[name]
    config = _save(tmp_path, preset, overrides)
    _check(compare(name, tmp_path, config), capsys)


@pytest.mark.parametrize("name", list(LARGE_CASES))
def test_vllm_paper_size_presets_equal_generate(name, tmp_path, capsys):
    preset, overrides = LARGE_CASES[name]
    config = _save(tmp_path, preset, overrides)
    _check(compare(name, tmp_path, config), capsys)


# ------------------------------------------------------------------------------------------------ refusals
def _refusal(folder, **engine) -> str:
    """The message of the error LLM(model=folder) raises (with its causes), or fail if it starts."""
    try:
        llm = vllm.LLM(model=str(folder), **{**ENGINE, **engine})
    except Exception as error:  # noqa: BLE001 - vLLM may wrap the model's ValueError
        messages = []
        while error is not None:
            messages.append(str(error))
            error = error.__cause__ or error.__context__
        return "\n".join(messages)
    close(llm)
    pytest.fail("vLLM started a model the plugin must refuse")


def test_unknown_variant_is_refused(tmp_path):
    _save(tmp_path, "tiny-switchhead", {})
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["attention_type"] = "linear"
    path.write_text(json.dumps(config))
    message = _refusal(tmp_path)
    assert "attention_type" in message and "linear" in message


def test_xl_too_wide_to_fold_is_refused(tmp_path):
    # head_dim 16 + 2 * ceil(500 / 2) = 516 channels per head: more than vLLM's largest head size (512)
    _save(tmp_path, "tiny-switchhead-xl", dict(hidden_size=500, vocab_size=64, num_hidden_layers=1))
    message = _refusal(tmp_path)
    assert "position_encoding='xl'" in message and "516" in message and "not covered" in message


def test_dynamic_rope_past_its_exact_length_is_refused(tmp_path):
    _save(tmp_path, "tiny-switchhead", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    message = _refusal(tmp_path, max_model_len=256)
    assert "dynamic" in message and "max_model_len=128" in message


def test_support_table_matches_the_presets():
    """The head sizes docs/serving.md states: padded to vLLM's CPU sizes, XL folded where it fits in 512."""
    from switchhead.vllm.support import CPU_HEAD_SIZES, check_supported, head_size_for

    sizes = {name: head_size_for(SwitchHeadConfig.from_preset(name), CPU_HEAD_SIZES)
             for name in ("tiny-switchhead", "tiny-switchhead-xl", "wt103-45m-switchhead-rope",
                          "c4-47m-switchhead-xl", "c4-47m-dense-xl", "wt103-243m-switchhead-rope")}
    assert sizes == {"tiny-switchhead": 32, "tiny-switchhead-xl": 80, "wt103-45m-switchhead-rope": 64,
                     "c4-47m-switchhead-xl": 512, "c4-47m-dense-xl": 512, "wt103-243m-switchhead-rope": 112}
    for name in ("c4-262m-switchhead-xl", "enwik8-41m-switchhead-xl", "c4-262m-dense-xl"):
        with pytest.raises(ValueError, match="not covered"):
            check_supported(SwitchHeadConfig.from_preset(name))


def test_older_tensor_names_map_to_todays(monkeypatch):
    """A tensor saved under a name the package has since renamed (switchhead.checkpoint_format.RENAMED_KEYS, where
    this release has renamings) loads into today's parameter."""
    from switchhead.vllm import model as vllm_model

    monkeypatch.setattr(vllm_model, "_renamed_keys", lambda: {"mlp.keys": "mlp.expert_keys"})
    parameters = dict.fromkeys(["model.layers.0.mlp.expert_keys", "model.layers.0.mlp.values"])
    assert vllm_model._current_name("model.layers.0.mlp.keys", parameters) == "model.layers.0.mlp.expert_keys"
    assert vllm_model._current_name("model.layers.0.mlp.values", parameters) == "model.layers.0.mlp.values"
    assert vllm_model._current_name("model.layers.0.mlp.other", parameters) == "model.layers.0.mlp.other"
