"""Quantised loading on CPU: bitsandbytes (int8, NF4) and torchao (int8 weight-only) on the dense projections.

The expert tensors and routers are `nn.Parameter`s that neither library converts: they must come through in full
precision and bit-identical. Each quantised model is held against a reference twin: the same model in fp32 with
each quantised weight replaced by its dequantised value. (On CUDA the same calls run with `device_map="auto"`; that
path is not exercised here: no GPU.)
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="the [quant] extra (installed by the test extra)")
pytest.importorskip("torchao", reason="the [quant] extra (installed by the test extra)")

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead.training.finetune import apply_lora, load_quantized  # noqa: E402

from helpers.models import logits_of  # noqa: E402

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
FULL_PRECISION = ("value_experts", "output_experts", "expert_keys", "expert_values", "selection", "mlp.gate",
                  "output_gate")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for preset in ("tiny-dense", "tiny-switchall"):
        torch.manual_seed(0)
        config = SwitchHeadConfig.from_preset(preset, vocab_size=128, hidden_size=128, intermediate_size=256)
        folder = tmp_path_factory.mktemp(preset)
        SwitchHeadForCausalLM(config).save_pretrained(folder)
        out[preset] = str(folder)
    return out


def _dequantised(weight) -> torch.Tensor | None:
    kind = type(weight).__name__
    if kind == "Int8Params":  # row-wise absmax int8
        return weight.data.float() * weight.SCB.float()[:, None] / 127
    if kind == "Params4bit":
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if hasattr(weight, "dequantize") and kind != "Parameter":  # torchao tensor subclasses
        return weight.dequantize().float()
    return None


def _twin(quantised, folder):
    """The fp32 model with every quantised Linear weight replaced by its dequantised value; returns the names."""
    twin = SwitchHeadForCausalLM.from_pretrained(folder).eval()
    names = []
    for name, module in quantised.named_modules():
        if isinstance(module, torch.nn.Linear):
            value = _dequantised(module.weight)
            if value is not None:
                twin.get_submodule(name).weight.data.copy_(value)
                names.append(name.rsplit(".", 1)[-1])
    return twin, names


def _relative(a, b) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


# torchao int8 weight-only computes x @ dequantised(W) in fp32: exact up to rounding. bitsandbytes' CPU NF4 kernel
# computes in lower precision (about bf16), and LLM.int8 also quantises the activations row-wise: relative errors.
@pytest.mark.parametrize("kind,atol,relative", [("torchao-int8", 1e-4, None), ("bnb-nf4", None, 0.01),
                                                ("bnb-int8", None, 0.05)])
def test_dense_projections_are_quantised_and_match_their_dequantised_twin(folders, kind, atol, relative):
    model = load_quantized(folders["tiny-dense"], kind).eval()
    twin, names = _twin(model, folders["tiny-dense"])
    assert set(names) == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"}  # lm_head kept
    assert type(model.lm_head.weight).__name__ == "Parameter" and model.lm_head.weight.dtype == torch.float32
    quantised, reference = logits_of(model, IDS).float(), logits_of(twin, IDS).float()
    full = logits_of(SwitchHeadForCausalLM.from_pretrained(folders["tiny-dense"]).eval(), IDS).float()
    if atol is not None:
        torch.testing.assert_close(quantised, reference, atol=atol, rtol=0)
    else:
        assert _relative(quantised, reference) < relative
    assert (quantised - full).abs().max() > 0  # it really is quantised
    if kind == "bnb-nf4":  # the twin explains the 4-bit error: much closer than the unquantised model
        assert _relative(quantised, reference) < _relative(quantised, full) / 3


@pytest.mark.parametrize("kind", ["torchao-int8", "bnb-nf4", "bnb-int8"])
def test_expert_tensors_and_routers_stay_full_precision_and_unchanged(folders, kind):
    original = SwitchHeadForCausalLM.from_pretrained(folders["tiny-switchall"])
    model = load_quantized(folders["tiny-switchall"], kind)
    kept = dict(original.named_parameters())
    checked = 0
    for name, parameter in model.named_parameters():
        if any(part in name for part in FULL_PRECISION):
            assert parameter.dtype == torch.float32 and torch.equal(parameter, kept[name]), name
            checked += 1
    assert checked == 2 * (2 + 2 + 3)  # per layer: V/O experts, keys/values, three routers
    _, names = _twin(model, folders["tiny-switchall"])
    assert set(names) == {"q_proj", "k_proj"}
    assert torch.isfinite(logits_of(model, IDS).float()).all()


def test_qlora_trains_adapters_on_an_nf4_base_including_the_expert_tensors(folders):
    model = apply_lora(load_quantized(folders["tiny-switchall"], "bnb-nf4"), r=4)
    wrapped = {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")}
    assert wrapped == {"value_experts", "output_experts", "expert_keys", "expert_values"}
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_finetune_cli_trains_lora_on_a_quantised_base(tmp_path, capsys):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from switchhead.cli import main as cli_main

    words = [f"w{i}" for i in range(100)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<eos>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                        pad_token="<eos>")
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer))
    SwitchHeadForCausalLM(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    generator = torch.Generator().manual_seed(0)
    # a learnable stream: each word is followed by the next one
    starts = torch.randint(0, 90, (400,), generator=generator).tolist()
    (tmp_path / "train.txt").write_text("\n".join(" ".join(words[s: s + 10]) for s in starts))
    common = [str(tmp_path / "base"), "--data", str(tmp_path / "train.txt"), "--quantize", "bnb-nf4",
              "--max-steps", "12", "--batch-size", "8", "--block-size", "32", "--learning-rate", "1e-2"]
    assert cli_main(["finetune", *common, "--output-dir", str(tmp_path / "merged"), "--merge"]) == 2
    assert "--merge with --quantize" in capsys.readouterr().err
    assert cli_main(["finetune", *common, "--output-dir", str(tmp_path / "out")]) == 0
    report = json.load(open(tmp_path / "out" / "finetune.json"))
    assert report["quantize"] == "bnb-nf4" and report["valid_loss_after"] < report["valid_loss_before"] - 0.5
