"""LoRA with PEFT on every variant: dense projections (target_modules) and expert tensors (target_parameters),
through our `apply_lora` / `load_lora` and through stock PEFT given `lora_targets(model)`.

Adapters start non-zero (`init_lora_weights=False`) so that every check below sees them act.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.version import Version

pytest.importorskip("peft", reason="the [peft] extra (installed by the test extra)")
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead.cli import main as cli_main  # noqa: E402
from switchhead.training.finetune import (  # noqa: E402
    FinetuneError,
    apply_lora,
    default_lora_targets,
    load_lora,
    lora_config,
    lora_targets,
    register_switchhead_modules,
)

from helpers.models import logits_of  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# PEFT 0.22 injects `target_parameters` before `target_modules` (0.21 the other way round)
_STOCK_PEFT_WRAPS_PARAMETERS_FIRST = Version(version("peft")) >= Version("0.22")

PRESETS = ["tiny-switchhead", "tiny-switchall", "tiny-dense", "tiny-switchhead-xl", "tiny-dense-xl",
           "tiny-switchall+xl", "tiny-moeut"]  # MoEUT: one adapter per shared block, used by each of its applications


def _base(preset: str, seed: int = 0) -> SwitchHeadForCausalLM:
    torch.manual_seed(seed)
    name, _, xl = preset.partition("+")  # "+xl": the preset with Transformer-XL attention
    overrides = {"position_encoding": "xl"} if xl else {}
    config = SwitchHeadConfig.from_preset(name, vocab_size=128, xl_memory_length=0, **overrides)
    return SwitchHeadForCausalLM(config).eval()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", PRESETS)
def test_lora_everywhere_trains_saves_adapter_only_reloads_and_merges(preset, tmp_path):
    ids = _ids()
    base_logits = logits_of(_base(preset), ids)
    model = apply_lora(_base(preset), r=2, init_lora_weights=False)
    modules, parameters = default_lora_targets(model.config)
    # every targeted tensor got LoRA factors, and only they train
    lora_names = [name for name, _ in model.named_parameters() if "lora_" in name]
    for name in modules:
        assert any(f".{name}.lora_A" in n for n in lora_names), name
    wrapped = {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")}
    assert wrapped == set(parameters)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())

    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name

    adapted = logits_of(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter changes the model

    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in key for key in saved)  # the adapter only, no base weight
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)

    reloaded = load_lora(_base(preset), str(tmp_path / "adapter"))
    assert torch.equal(logits_of(reloaded, ids), adapted)

    merged = reloaded.merge_and_unload()
    assert type(merged) is SwitchHeadForCausalLM
    assert merged.state_dict().keys() == _base(preset).state_dict().keys()
    torch.testing.assert_close(logits_of(merged, ids), adapted, atol=1e-5, rtol=0)
    merged.save_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids), adapted,
                               atol=1e-5, rtol=0)


def _hand_delta(wrapper) -> torch.Tensor:
    """The LoRA update of an `[E, in, out]` expert tensor from the factors, written out expert by expert."""
    a = wrapper.lora_A["default"].weight  # [r*E, in]
    b = wrapper.lora_B["default"].weight  # [out, r*E]
    experts = wrapper.get_param().shape[0]
    rank = a.shape[0] // experts
    a = a.view(experts, rank, -1)
    b = b.view(b.shape[0], rank, experts)
    scale = wrapper.scaling["default"]
    return torch.stack([scale * a[e].T @ b[:, :, e].T for e in range(experts)])


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchhead-xl", "tiny-moeut"])
def test_expert_lora_equals_a_model_with_each_expert_updated_by_hand(preset):
    """Reference twin: W_e + s * A_e^T B_e^T per expert, [experts, in, out], in a plain model."""
    ids = _ids(3)
    _, parameters = default_lora_targets(_base(preset).config)
    model = apply_lora(_base(preset), r=3, target_modules=[], target_parameters=parameters, init_lora_weights=False)
    reference = _base(preset)
    wrappers = [m for m in model.modules() if hasattr(m, "parameter_name")]
    assert len(wrappers) == len(parameters) * reference.config.num_distinct_layers  # shared blocks: one each
    with torch.no_grad():
        for wrapper in wrappers:
            owner_name = next(n for n, m in model.base_model.model.named_modules() if m is wrapper.get_base_layer())
            owner_name = owner_name.replace(".base_layer", "")
            tensor = getattr(reference.get_submodule(owner_name), wrapper.parameter_name)
            assert wrapper.in_features == tensor.shape[1] and wrapper.out_features == tensor.shape[2]
            tensor.add_(_hand_delta(wrapper))
    torch.testing.assert_close(logits_of(model, ids), logits_of(reference, ids), atol=1e-5, rtol=0)


def _tuner_layers(model) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


@pytest.mark.parametrize("preset", PRESETS)
def test_stock_peft_with_lora_targets_adapts_every_expert_saves_reloads_and_merges(preset, tmp_path):
    """No wrapper or hook of ours: `LoraConfig(**lora_targets(model))`, `get_peft_model`, `save_pretrained`,
    `PeftModel.from_pretrained`, `merge_and_unload`, as a PEFT user writes them. From PEFT 0.22, which wraps expert
    tensors before it adapts `target_modules`, stock PEFT cannot reach `q_proj` / `k_proj` inside SwitchHead attention
    whose experts are adapted too: that failure is asserted, and the same calls then run with the one hook of ours
    the module docstring names (`register_switchhead_modules` on the `LoraConfig`)."""
    from peft import LoraConfig, get_peft_model

    ids = _ids(4)
    base = _base(preset)
    base_logits = logits_of(base, ids)
    targets = lora_targets(base)
    attention_experts = {"value_experts", "output_experts"} & set(targets["target_parameters"])
    hook = bool(_STOCK_PEFT_WRAPS_PARAMETERS_FIRST and attention_experts)
    if hook:
        with pytest.raises(AttributeError, match="ParamWrapper has no attribute `q_proj`"):
            get_peft_model(_base(preset), LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **targets))
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **targets)
    model = get_peft_model(base, register_switchhead_modules(config) if hook else config)
    wrapped = [(type(m).__name__, m.parameter_name) for m in model.modules() if hasattr(m, "parameter_name")]
    assert {name for _, name in wrapped} == set(targets["target_parameters"])  # every kind of expert tensor ...
    assert len(wrapped) == len(targets["target_parameters"]) * base.config.num_distinct_layers  # ... in every block
    assert {kind for kind, _ in wrapped} <= {"ParamWrapper"}  # PEFT's own (with the hook: ours, by PEFT's name)
    assert set(targets["target_parameters"]) >= ({"expert_keys", "expert_values"} if "switchall" in preset else set())
    adapted = logits_of(model, ids)
    assert (adapted - base_logits).abs().max() > 1e-3

    model.save_pretrained(tmp_path / "adapter")
    saved = LoraConfig.from_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_base(preset), tmp_path / "adapter",
                                         config=register_switchhead_modules(saved) if hook else saved)
    assert torch.equal(logits_of(reloaded, ids), adapted)

    merged = reloaded.merge_and_unload()
    # PEFT 0.21 skips LoRA layers inside a module it has wrapped itself: q_proj / k_proj of an attention layer whose
    # experts are adapted stay (active, unmerged) until a second call
    leftover = _tuner_layers(merged)
    assert all(".self_attn." in name for name in leftover), leftover
    if leftover:
        merged = reloaded.merge_and_unload()
    assert not _tuner_layers(merged)
    assert type(merged) is SwitchHeadForCausalLM
    assert merged.state_dict().keys() == _base(preset).state_dict().keys()
    torch.testing.assert_close(logits_of(merged, ids), adapted, atol=1e-5, rtol=0)


def test_adapter_saved_before_the_rename_loads_with_identical_logits():
    """An adapter of `apply_lora` from before the sigma-MoE tensors were renamed (`target_parameters` `keys` /
    `values`; tests/fixtures/pre_rename_adapter/make.py), on a base folder saved under the old names too."""
    folder = FIXTURES / "pre_rename_adapter"
    assert {"keys", "values"} <= set(json.loads((folder / "adapter_config.json").read_text())["target_parameters"])
    base = SwitchHeadForCausalLM.from_pretrained(FIXTURES / "pre_redesign" / "switchall", dtype=torch.float32)
    expected = load_file(str(folder / "expected.safetensors"))
    base_logits = logits_of(base, expected["input_ids"])
    # not make.py's seed: LoRA tensors that do not load keep an initialisation that must not match the saved ones
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*missing adapter keys")  # every saved LoRA tensor is read
        model = load_lora(base, str(folder))
    assert {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")} == \
        {"value_experts", "output_experts", "expert_keys", "expert_values"}
    # 1e-5 as for the pre-redesign checkpoints: the code that wrote expected.safetensors (on an AMD EPYC) gives logits
    # 3.1e-6 from them on an Intel Xeon (its matmul kernels round differently); the adapter itself moves them by 4.7
    torch.testing.assert_close(logits_of(model, expected["input_ids"]), expected["logits"], atol=1e-5, rtol=0)
    assert (base_logits - expected["logits"]).abs().max() > 1e-1


def test_lora_config_refuses_targets_the_model_does_not_have():
    config = SwitchHeadConfig.from_preset("tiny-switchhead")
    with pytest.raises(FinetuneError, match="target parameter 'keys' is not in this switchhead/dense model"):
        lora_config(config, target_parameters=["keys"])
    with pytest.raises(FinetuneError, match="target module 'v_proj'"):
        lora_config(config, target_modules=["v_proj"])
    with pytest.raises(FinetuneError, match="lora_dropout must be 0"):
        lora_config(config, lora_dropout=0.1)
    with pytest.raises(FinetuneError, match="rank must be >= 1"):
        lora_config(config, r=0)


# ============================================================================================ the CLI, on real text
def _model_folder(shared_data, tmp_path, preset: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (shared_data / "wikitext-2" / "wiki.train.tokens").read_text(encoding="utf-8")[:100_000]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=256,
                                                                       special_tokens=["<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                        pad_token="<eos>")
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    folder = str(tmp_path / "base")
    SwitchHeadForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-dense-xl"])
def test_finetune_cli_lowers_the_loss_and_writes_a_loadable_adapter(shared_data, tmp_path, capsys, preset):
    base = _model_folder(shared_data, tmp_path, preset)
    data = str(shared_data / "wikitext-2")
    out = str(tmp_path / "adapter")
    assert cli_main(["finetune", base, "--data", data, "--output-dir", out, "--rank", "4", "--max-steps", "25",
                     "--batch-size", "8", "--block-size", "64", "--learning-rate", "3e-3", "--merge"]) == 0
    report = json.load(open(os.path.join(out, "finetune.json")))
    assert report["valid_loss_after"] < report["valid_loss_before"] - 0.3
    assert report["train_losses"][-1] < report["train_losses"][0]
    assert report["trainable_parameters"] < report["total_parameters"] / 4
    assert "perplexity" in capsys.readouterr().out
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert all("lora_" in key for key in saved)
    assert not os.path.exists(os.path.join(out, "trainer"))

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    adapted = logits_of(load_lora(AutoModelForCausalLM.from_pretrained(base), out), ids)
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"))
    torch.testing.assert_close(logits_of(merged, ids), adapted, atol=1e-5, rtol=0)
    assert math.isfinite(report["valid_loss_after"])


def test_finetune_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli_main(["finetune", str(tmp_path / "nope"), "--data", str(tmp_path), "--output-dir",
                     str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("switchhead finetune: error:") and "config.json" in err[0]
    _base("tiny-switchhead").save_pretrained(tmp_path / "m")
    assert cli_main(["finetune", str(tmp_path / "m"), "--data", str(tmp_path), "--output-dir", str(tmp_path / "o"),
                     "--target-parameters", "keys"]) == 2
    assert "target parameter 'keys'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")
