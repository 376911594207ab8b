"""Upcycling: a dense attention model into a SwitchHead one, so that MoE-attention training starts from it.

    switchhead upcycle runs/dense runs/upcycled --heads 2 --experts 4 --k 2
    switchhead upcycle my-gpt2/ runs/upcycled --heads 4 --experts 4 --k 2     # a GPT-2 style Transformers folder

The dense model has `Hd` heads of width `dh`; the SwitchHead model keeps `H` of them (`Hd` divisible by `H`): the
dense heads are cut into `H` groups of `G = Hd / H` consecutive heads, and group `h` becomes SwitchHead head `h`.

- Q and K (and XL's position-key rows) of head `h` are those of the group's first dense head (the attention pattern
  it keeps; the other heads' patterns are lost when G > 1).
- V and O become the head's `E` experts (`--expert-init`):
  * `heads`: expert `e` is dense head `h*G + (e mod G)`'s V and O, so each expert is one dense head;
  * `svd` (default): every expert of head `h` is the best rank-`dh` factorisation of the group's summed value-output
    map `sum_j V_j O_j` (`[d, d]`, truncated SVD split as `U sqrt(S)` / `sqrt(S) V^T`); with G = 1 that is the dense
    head exactly. Experts then start equal and are told apart by their routers during training.
- Routers start near zero (`--router-noise`: std of the initial router logits), so every gate is about
  sigmoid(0) = 1/2; V and O experts are scaled so that the k selected gates sum to the dense head's weight (2/k
  for equal experts). With G = 1 and `--router-noise 0`, the first forward equals the dense model's exactly; with
  G > 1 it is as close as one attention pattern per group allows (the logits' distance is printed and returned).
- Embeddings, LayerNorms, the MLP and the output layer are copied unchanged. A dense output gate
  (`attention_output_gate`) becomes the output routers (each expert's router row = the head's gate row).

A GPT-2 style Transformers folder (`model_type` gpt2) is read as a dense model first. Its layout only partly fits:
GPT-2's learned absolute positions (`wpe`) have no place in our RoPE / XL attention, and its attention biases
(q, k, v, output projection) have none either; they are dropped (listed in the result), so the upcycled model is
a starting point for continued training, not a copy of GPT-2. `gelu_new` becomes the exact `gelu`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.integrity import check_model_size, check_saved_model

from .checkpoint_io import ConversionError, atomic_output, load_hf_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "generation_config.json")


@dataclass
class UpcycleResult:
    config: SwitchHeadConfig
    state_dict: dict[str, torch.Tensor]
    dropped: list[str] = field(default_factory=list)  # source tensors with no place in the model (GPT-2)
    notes: list[str] = field(default_factory=list)


# ============================================================================================ GPT-2 -> dense
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def dense_from_gpt2(config: dict, tensors: dict[str, torch.Tensor]) -> UpcycleResult:
    """A GPT-2 (`GPT2LMHeadModel`) config dict and state dict -> our dense RoPE model's config and state dict."""
    problems = []
    if config.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx=True")
    if not config.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=False")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        problems.append(f"activation_function={activation!r}")
    if config.get("add_cross_attention"):
        problems.append("add_cross_attention=True")
    if problems:
        raise ConversionError("this GPT-2 checkpoint's layout does not fit a SwitchHead model: " + ", ".join(problems))
    d, layers, heads = int(config["n_embd"]), int(config["n_layer"]), int(config["n_head"])
    inner = int(config.get("n_inner") or 4 * d)
    prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
    t = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    needed = ["wte.weight", "ln_f.weight", "ln_f.bias"]
    for i in range(layers):
        needed += [f"h.{i}.{name}" for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_proj.weight",
                                                "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                                "mlp.c_proj.weight", "mlp.c_proj.bias")]
    missing = [name for name in needed if name not in t]
    if missing:
        raise ConversionError(f"the GPT-2 checkpoint is missing {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}")
    vocab = int(t["wte.weight"].shape[0])

    def token(name: str):  # GPT2Config defaults its special tokens to 50256 even for other vocabularies
        value = config.get(name)
        return value if isinstance(value, int) and 0 <= value < vocab else None
    ours = SwitchHeadConfig(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, head_dim=d // heads,
        attention_type="dense", position_encoding="rope", partial_rotary_factor=0.5,
        max_position_embeddings=int(config.get("n_positions", 1024)), intermediate_size=inner, mlp_type="dense",
        hidden_act=_GPT2_ACTIVATIONS[activation], layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        mlp_bias=True, lm_head_bias=False, tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        bos_token_id=token("bos_token_id"), eos_token_id=token("eos_token_id"), pad_token_id=token("pad_token_id"),
    )
    state = {"model.embed_tokens.weight": t["wte.weight"], "model.norm.weight": t["ln_f.weight"],
             "model.norm.bias": t["ln_f.bias"]}
    state["lm_head.weight"] = tensors.get("lm_head.weight", t["wte.weight"])
    used = {"wte.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"}
    for i in range(layers):
        p, q = f"h.{i}.", f"model.layers.{i}."
        qkv = t[p + "attn.c_attn.weight"]  # Conv1D: [d, 3d], y = x W + b
        state.update({
            q + "input_layernorm.weight": t[p + "ln_1.weight"], q + "input_layernorm.bias": t[p + "ln_1.bias"],
            q + "self_attn.q_proj.weight": qkv[:, :d].T.contiguous(),
            q + "self_attn.k_proj.weight": qkv[:, d: 2 * d].T.contiguous(),
            q + "self_attn.v_proj.weight": qkv[:, 2 * d:].T.contiguous(),
            q + "self_attn.o_proj.weight": t[p + "attn.c_proj.weight"].T.contiguous(),
            q + "post_attention_layernorm.weight": t[p + "ln_2.weight"],
            q + "post_attention_layernorm.bias": t[p + "ln_2.bias"],
            q + "mlp.up_proj.weight": t[p + "mlp.c_fc.weight"].T.contiguous(),
            q + "mlp.up_proj.bias": t[p + "mlp.c_fc.bias"],
            q + "mlp.down_proj.weight": t[p + "mlp.c_proj.weight"].T.contiguous(),
            q + "mlp.down_proj.bias": t[p + "mlp.c_proj.bias"],
        })
        used.update(p + name for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_proj.weight",
                                          "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                          "mlp.c_proj.weight", "mlp.c_proj.bias"))
    buffers = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old GPT-2 checkpoints, not weights
    dropped = sorted(k for k in t if k not in used and not k.endswith(buffers))
    notes = ["GPT-2's learned absolute positions (wpe) and attention biases have no place in this architecture and "
             "were dropped: continue training before use"]
    if activation != _GPT2_ACTIVATIONS[activation]:
        notes.append(f"activation {activation} replaced by {_GPT2_ACTIVATIONS[activation]}")
    return UpcycleResult(ours, state, dropped, notes)


# ============================================================================================ dense -> SwitchHead
def upcycle_state_dict(config: SwitchHeadConfig, state: dict[str, torch.Tensor], heads: int, experts: int, k: int,
                       expert_init: str = "svd", router_noise: float = 0.01, seed: int = 0) -> UpcycleResult:
    """Our dense model (config + state dict) -> a SwitchHead model's config and state dict (see the module doc)."""
    if config.attention_type != "dense":
        raise ConversionError(f"the source must be a dense attention model, this one is {config.attention_type!r}")
    dense_heads, dh, d = config.num_attention_heads, config.head_dim, config.hidden_size
    if heads < 1 or dense_heads % heads:
        raise ConversionError(f"--heads must divide the dense model's {dense_heads} heads, got {heads}")
    if experts < 1 or not 1 <= k <= experts:
        raise ConversionError(f"need --experts >= 1 and 1 <= --k <= --experts, got experts={experts}, k={k}")
    if expert_init not in ("svd", "heads"):
        raise ConversionError(f"--expert-init must be 'svd' or 'heads', got {expert_init!r}")
    if not math.isfinite(router_noise) or router_noise < 0:  # NaN would pass `< 0` and save NaN routers
        raise ConversionError(f"--router-noise must be a finite number >= 0, got {router_noise}")
    group = dense_heads // heads
    fields = config.to_diff_dict()
    fields.pop("transformers_version", None)
    fields.update(attention_type="switchhead", num_attention_heads=heads, num_attention_experts=experts,
                  num_attention_experts_per_tok=k, attention_output_gate=False)
    try:
        new_config = SwitchHeadConfig(**fields)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"the upcycled architecture is invalid: {error}") from None
    check_model_size(new_config, what="the upcycled model")  # before the experts are stacked (--experts 10^9)

    generator = torch.Generator().manual_seed(seed)
    router_std = router_noise / d**0.5  # LayerNorm outputs have norm ~ sqrt(d): logits get std ~ router_noise
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if not (key.startswith("model.layers.") and parts[3] == "self_attn"):
            out[key] = tensor
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        kept = [h * group for h in range(heads)]  # each group's first dense head keeps its Q/K

        def rows(weight: torch.Tensor) -> torch.Tensor:  # [Hd*dh, d] -> the kept heads' rows [H*dh, d]
            return weight.view(dense_heads, dh, -1)[kept].reshape(heads * dh, -1)

        out[p + "q_proj.weight"] = rows(state[p + "q_proj.weight"])
        out[p + "k_proj.weight"] = rows(state[p + "k_proj.weight"])
        if config.position_encoding == "xl":
            out[p + "position_key_proj.weight"] = rows(state[p + "position_key_proj.weight"])
        work = torch.promote_types(state[p + "v_proj.weight"].dtype, torch.float32)
        value = state[p + "v_proj.weight"].to(work).view(dense_heads, dh, d).transpose(1, 2)  # V_j: [Hd, d, dh]
        output = state[p + "o_proj.weight"].to(work).T.reshape(dense_heads, dh, d)  # O_j: [Hd, dh, d]
        gate = state.get(p + "output_gate")
        # gate sums: the k selected value gates are ~1/2 each; output gates too, or the dense gate itself
        value_scale, output_scale = 2.0 / k, (1.0 / k if gate is not None else 2.0 / k)
        value_experts, output_experts = [], []
        for h in range(heads):
            members = list(range(h * group, (h + 1) * group))
            if expert_init == "svd":
                combined = sum(value[j] @ output[j] for j in members)  # [d, d]
                u, s, vh = torch.linalg.svd(combined.double(), full_matrices=False)
                root = s[:dh].sqrt()
                v_e, o_e = (u[:, :dh] * root).to(work), (root[:, None] * vh[:dh]).to(work)
                value_experts += [v_e * value_scale] * experts
                output_experts += [o_e * output_scale] * experts
            else:
                for e in range(experts):
                    j = members[e % group]
                    # a selection covers about min(k, G) distinct dense heads: their sum is the group's output
                    factor = min(k, group)
                    value_experts.append(value[j] * value_scale * factor)
                    output_experts.append(output[j] * output_scale * factor)
        dtype = state[p + "v_proj.weight"].dtype
        out[p + "value_experts"] = torch.stack(value_experts).to(dtype)
        out[p + "output_experts"] = torch.stack(output_experts).to(dtype)
        def noise() -> torch.Tensor:
            return torch.randn(heads * experts, d, generator=generator, dtype=torch.float64) * router_std

        out[p + "value_selection.weight"] = noise().to(dtype)
        if gate is not None:
            out[p + "output_selection.weight"] = (gate[kept].double().repeat_interleave(experts, 0) + noise()).to(dtype)
        else:
            out[p + "output_selection.weight"] = noise().to(dtype)
    notes = [f"{dense_heads} dense heads -> {heads} heads x {experts} experts (k={k}), expert init {expert_init}"]
    if group > 1:
        notes.append(f"each SwitchHead head keeps the attention pattern of 1 of {group} dense heads")
    return UpcycleResult(new_config, out, [], notes)


def _check_shapes(config: SwitchHeadConfig, state: dict[str, torch.Tensor], folder: str) -> None:
    """ConversionError for the first tensor whose shape does not fit `config` (GPT-2's sizes come from its config,
    its tensors from the files: they may disagree)."""
    with torch.device("meta"):
        expected = SwitchHeadForCausalLM(config).state_dict()
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConversionError(f"{folder}: the tensor that becomes {name} has shape {list(tensor.shape)}, but "
                                  f"config.json makes it {list(expected[name].shape)}; the weights do not belong to "
                                  "this config.json")


def _read_source(folder: str, verify: bool = True) -> UpcycleResult:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ConversionError(f"{folder} is not a saved model folder (it has no config.json)")
    with open(config_path, encoding="utf-8") as handle:
        raw = json.load(handle)
    if raw.get("model_type") == "gpt2":
        from safetensors.torch import load_file

        from switchhead.integrity.loading import weight_files

        check_saved_model(folder, verify=verify, model_type="gpt2")
        tensors: dict[str, torch.Tensor] = {}
        for name in weight_files(folder):
            tensors.update(load_file(os.path.join(folder, name)))
        dense = dense_from_gpt2(raw, tensors)
        _check_shapes(dense.config, dense.state_dict, folder)
        return dense
    if raw.get("model_type") != "switchhead":
        raise ConversionError(f"{folder} holds a {raw.get('model_type')!r} model; upcycling reads this package's dense "
                              f"models and GPT-2 style ones")
    config, state = load_hf_folder(folder, verify=verify)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return UpcycleResult(config, state)


def upcycle(source: str, output: str, heads: int, experts: int, k: int, expert_init: str = "svd",
            router_noise: float = 0.01, seed: int = 0, check_tokens: int = 64,
            verify: bool = True) -> tuple[UpcycleResult, float]:
    """Upcycle the model in folder `source` into a new `save_pretrained` folder `output` (tokenizer files copied).

    Returns the result and the largest logit difference between the source (as our dense model) and the
    upcycled model on `check_tokens` random tokens (the first-forward closeness). The source folder is checked
    first (`switchhead.integrity.check_saved_model`; `verify=False` skips its manifest).
    """
    dense = _read_source(source, verify)
    result = upcycle_state_dict(dense.config, dense.state_dict, heads, experts, k, expert_init, router_noise, seed)
    result.dropped, result.notes = dense.dropped, dense.notes + result.notes
    dense_model = _build(dense.config, dense.state_dict)
    model = _build(result.config, result.state_dict)
    ids = torch.randint(0, dense.config.vocab_size, (1, min(check_tokens, dense.config.max_position_embeddings)),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        difference = (model(ids).logits - dense_model(ids).logits).abs().max().item()
    with atomic_output(output, is_dir=True) as staging:
        model.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)) and not os.path.exists(os.path.join(staging, name)):
                shutil.copy(os.path.join(source, name), os.path.join(staging, name))
        with open(os.path.join(staging, "upcycle.json"), "w", encoding="utf-8") as handle:
            json.dump({"source": os.path.abspath(source), "heads": heads, "experts": experts, "k": k,
                       "expert_init": expert_init, "router_noise": router_noise, "seed": seed,
                       "first_forward_max_logit_difference": difference, "dropped": result.dropped,
                       "notes": result.notes}, handle, indent=2)
    return result, difference


def _build(config: SwitchHeadConfig, state: dict[str, torch.Tensor]) -> SwitchHeadForCausalLM:
    model = SwitchHeadForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"internal mapping error: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


__all__ = ["UpcycleResult", "dense_from_gpt2", "upcycle", "upcycle_state_dict"]
