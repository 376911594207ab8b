"""The authors' checkpoint layouts, mapped to and from ours.

Two layouts exist (the paper's training code and the authors' user-facing module):

1. The paper's training code (RobertCsordas/moe_attention): `torch.save` of a dict whose `model` entry is the
   `TransformerLanguageModel` state dict and whose `run_invariants["args"]` is the run's flat argument dict
   (dotted names such as `"transformer.n_heads"`). Supported runs: the pre-LN SwitchHead model
   (`transformer.variant="preln_moeatt"`) and SwitchAll (`"preln_moe"` with `moe.att.enable=1`), with
   Transformer-XL (`moe.att.variant="full"`) or RoPE (`"full_rope"`) attention and MoE on V and O only.
2. The user-facing module (RobertCsordas/switchhead, `SwitchHeadRope` / `SwitchHeadXL`) inside a Transformer
   the user built: per attention layer `q.weight, k.weight, v, o, sel_v, sel_o` (+ `pos_to_pk` for XL) under a
   layer prefix such as `"blocks.{i}.attn."`; the rest of the user's model is mapped by prefix renames. With one
   expert per head (`n_experts=1`) the module has `q.weight, k.weight, v [H*dh, d], o [d, H*dh], sel_o [H, d]`
   (a gated dense attention, no `sel_v`): that is our `attention_type="dense"` with `attention_output_gate=True`
   (`v_proj.weight`, `o_proj.weight`, `output_gate`), converted both ways by the same functions.

Tensor mapping (layer `i`; `H` heads, `E` experts per head, `d` width, `dh` head width, `S` expert size):

| ours (in `model.layers.{i}.`)          | training code (in `unique_layers.{i}.`)  | module     | shape             |
|----------------------------------------|------------------------------------------|------------|-------------------|
| model.embed_tokens.weight (top)        | embedding.weight (top)                   | -          | [V, d]            |
| input_layernorm.{weight,bias}          | norm1.{weight,bias}                      | -          | [d]               |
| self_attn.q_proj.weight                | self_attn.projections.q (old: data_to_q) | q.weight   | [H*dh, d]         |
| self_attn.k_proj.weight                | self_attn.projections.k (old: data_to_k) | k.weight   | [H*dh, d]         |
| self_attn.value_experts                | self_attn.projections.v (old: data_to_v) | v          | [H*E, d, dh]      |
| self_attn.output_experts               | self_attn.projections.o (old: out_proj)  | o          | [H*E, dh, d]      |
| self_attn.value_selection.weight       | self_attn.selections.v (old: sel_src)    | sel_v      | [H*E, d]          |
| self_attn.output_selection.weight      | self_attn.selections.o (old: sel_dst)    | sel_o      | [H*E, d]          |
| self_attn.position_key_proj.weight     | self_attn.pos_to_pk (XL only)*           | pos_to_pk* | [H*dh, d]         |
| post_attention_layernorm.{weight,bias} | norm2.{weight,bias}                      | -          | [d]               |
| mlp.up_proj.{weight,bias}              | linear1.{weight,bias}                    | -          | [d_ff, d], [d_ff] |
| mlp.down_proj.{weight,bias}            | linear2.{weight,bias}                    | -          | [d, d_ff], [d]    |
| mlp.experts.expert_keys                | pkm.keys (SwitchAll)                     | -          | [E_mlp, d, S]     |
| mlp.experts.expert_values              | pkm.values (SwitchAll)                   | -          | [E_mlp, S, d]     |
| mlp.gate.weight                        | pkm.expert_sel (SwitchAll)               | -          | [E_mlp, d]        |
| model.norm.{weight,bias} (top)         | out_norm.{weight,bias} (top)             | -          | [d]               |
| lm_head.{weight,bias} (top)            | output.{weight,bias} (top)               | -          | [V, d], [V]       |

(top): not inside a layer. Old names may carry a `.weight` suffix. Expert `h*E + e` is expert `e` of head `h`
on both sides, so the expert tensors are copied unchanged. *`pos_to_pk` multiplies the sinusoidal encoding,
whose channels both sides interleave (`sin f0, cos f0, sin f1, ...`; checked on every XL conversion).
Dropped on import: the sigma-MoE usage statistics buffers (`pkm.kv_sel_counts_100`, and `kv_sel_counts`,
`index_sel_counts*`, `coocurence`, `iter`, `seq` in older checkpoints); export writes `pkm.kv_sel_counts_100` as
zeros because the authors' loader expects it.

The attention arithmetic is the same on both sides: q and k are each scaled by dh^-1/4 (ours: one dh^-1/2 on
the scores), the XL term is q . (W_pk PE(j - i)) with the same scaling, gates are sigmoid scores of the top-k
(no renormalisation), the value selection reads the attended-to token and the output selection the attending
one; pre-LN blocks, a final LayerNorm, and an untied output layer with a bias (the pre-LN models use no
embedding scale).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

from .checkpoint_io import ConversionError

# ----------------------------------------------------------------------------------------------- name tables
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embedding.weight",
    "model.norm.weight": "out_norm.weight",
    "model.norm.bias": "out_norm.bias",
    "lm_head.weight": "output.weight",
    "lm_head.bias": "output.bias",
}
_BLOCK = {  # our name inside model.layers.{i}. -> the training code's name inside unique_layers.{i}.
    "input_layernorm.weight": "norm1.weight",
    "input_layernorm.bias": "norm1.bias",
    "post_attention_layernorm.weight": "norm2.weight",
    "post_attention_layernorm.bias": "norm2.bias",
    "self_attn.q_proj.weight": "self_attn.projections.q",
    "self_attn.k_proj.weight": "self_attn.projections.k",
    "self_attn.value_experts": "self_attn.projections.v",
    "self_attn.output_experts": "self_attn.projections.o",
    "self_attn.value_selection.weight": "self_attn.selections.v",
    "self_attn.output_selection.weight": "self_attn.selections.o",
    "self_attn.position_key_proj.weight": "self_attn.pos_to_pk",
    "mlp.up_proj.weight": "linear1.weight",
    "mlp.up_proj.bias": "linear1.bias",
    "mlp.down_proj.weight": "linear2.weight",
    "mlp.down_proj.bias": "linear2.bias",
    "mlp.experts.expert_keys": "pkm.keys",
    "mlp.experts.expert_values": "pkm.values",
    "mlp.gate.weight": "pkm.expert_sel",
}
_OLD_ATTENTION_NAMES = {  # pre-release names of the training code's SwitchHead tensors
    "sel_src": "selections.v", "sel_dst": "selections.o",
    "data_to_q": "projections.q", "data_to_k": "projections.k", "data_to_v": "projections.v",
    "out_proj": "projections.o",
}
_STATISTICS = ("kv_sel_counts", "kv_sel_counts_100", "index_sel_counts", "index_sel_counts_100", "coocurence",
               "iter", "seq")
_MODULE = {  # the user-facing module's names -> ours inside model.layers.{i}.
    "q.weight": "self_attn.q_proj.weight",
    "k.weight": "self_attn.k_proj.weight",
    "v": "self_attn.value_experts",
    "o": "self_attn.output_experts",
    "sel_v": "self_attn.value_selection.weight",
    "sel_o": "self_attn.output_selection.weight",
    "pos_to_pk": "self_attn.position_key_proj.weight",
}
# The module with one expert per head (n_experts=1) is a gated dense attention: `v` [H*dh, d] and `o` [d, H*dh] are
# plain linear weights, `sel_o` [H, d] a per-head sigmoid output gate, and there is no `sel_v`. That is our dense
# layer with `attention_output_gate=True`, tensor for tensor.
_MODULE_ONE_EXPERT = {
    "q.weight": "self_attn.q_proj.weight",
    "k.weight": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "sel_o": "self_attn.output_gate",
    "pos_to_pk": "self_attn.position_key_proj.weight",
}


def module_names(config: SwitchHeadConfig) -> dict[str, str]:
    """The user-facing module's tensor names -> ours (inside model.layers.{i}.) for `config`'s attention."""
    if config.attention_type == "switchhead":
        if getattr(config, "attention_expert_projections", "value_output") != "value_output":
            raise ConversionError(f"attention_expert_projections={config.attention_expert_projections!r} (the "
                                  "value-only / output-only ablation) has no mapping to the authors' format")
        return _MODULE
    if config.attention_output_gate:
        return _MODULE_ONE_EXPERT
    raise ConversionError("the authors' SwitchHead module has no equivalent of a dense attention without an output "
                          "gate; its one-expert form (n_experts=1) is attention_type='dense' with "
                          "attention_output_gate=True")
# the config fields a drop-in layer (`switchhead.layers`) describes: it carries the config of the layer it wraps
_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "head_dim", "attention_type", "attention_output_gate",
                     "num_attention_experts", "num_attention_experts_per_tok", "attention_expert_dropout",
                     "position_encoding", "partial_rotary_factor", "rope_parameters")
_MLP_FIELDS = ("mlp_type", "num_mlp_experts", "mlp_expert_size", "num_mlp_experts_per_tok", "mlp_expert_dropout",
               "hidden_act")


def config_fields_from_layers(attention, mlp=None) -> dict[str, Any]:
    """The `SwitchHeadConfig` fields that a model's drop-in attention layer (`switchhead.SwitchHeadRope` /
    `SwitchHeadXL`) and, if given, its sigma-MoE (`switchhead.SigmaMoE`) describe; the caller adds the rest
    (`vocab_size`, `num_hidden_layers`, a dense MLP's `intermediate_size`, ...). The module conversion
    (`state_dict_from_module` with `layer_prefix` at the attention layers) then maps their tensors."""
    from switchhead.layers import SigmaMoE, SwitchHeadRope, SwitchHeadXL

    if not isinstance(attention, (SwitchHeadRope, SwitchHeadXL)):
        raise ConversionError(f"attention is a {type(attention).__name__}; config_fields_from_layers reads "
                              "switchhead.SwitchHeadRope or SwitchHeadXL (for the authors' own module, give the "
                              "config's fields yourself)")
    fields = {name: getattr(attention.config, name) for name in _ATTENTION_FIELDS}
    if mlp is not None:
        if not isinstance(mlp, SigmaMoE):
            raise ConversionError(f"mlp is a {type(mlp).__name__}; config_fields_from_layers reads switchhead.SigmaMoE")
        fields.update({name: getattr(mlp.config, name) for name in _MLP_FIELDS})
    return fields


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


# ----------------------------------------------------------------------------------------------- checks
def expected_shapes(config: SwitchHeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of our model for `config`, with its shape (built on the meta device: no memory used)."""
    with torch.device("meta"):
        model = SwitchHeadForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _listing(names, limit: int = 6) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  source_name: dict[str, str], what: str) -> None:
    """Raise ConversionError naming unknown keys, missing keys or mismatched shapes (in the file's own names)."""
    unknown = [source_name.get(k, k) for k in tensors if k not in expected]
    if unknown:
        raise ConversionError(f"{what} has unknown keys that the model has no place for: {_listing(unknown)}")
    missing = [source_name.get(k, k) for k in expected if k not in tensors]
    if missing:
        raise ConversionError(f"{what} is missing keys: {_listing(missing)}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise ConversionError(
                f"{what}: {source_name.get(key, key)} has shape {list(tensors[key].shape)}, but the architecture "
                f"needs {list(shape)}"
            )
        if not tensors[key].is_floating_point():
            raise ConversionError(f"{what}: {source_name.get(key, key)} is {tensors[key].dtype}, not a float tensor")


# ----------------------------------------------------------------------------------------------- XL encoding
def authors_sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The authors' sinusoidal encoding `[P]` -> `[P, dim]`: channels interleaved, sin(p w_c) at 2c, cos at 2c+1."""
    frequencies = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    angles = positions.to(torch.float64)[:, None] * frequencies[None, :]
    encoding = torch.zeros(len(positions), dim, dtype=torch.float64)
    encoding[:, 0::2] = angles.sin()
    encoding[:, 1::2] = angles.cos()[:, : dim // 2]
    return encoding


def check_position_encoding(dim: int) -> None:
    """Make sure our XL encoding is the authors' channel for channel, so `pos_to_pk` can be copied unchanged.

    A model version whose encoding differs would silently change every converted XL model; refuse instead.
    """
    from switchhead.positions import sinusoidal_embedding

    positions = torch.arange(-64, 64)
    ours = sinusoidal_embedding(positions, dim).to(torch.float64)
    if not torch.allclose(ours, authors_sinusoid(positions, dim), atol=1e-5, rtol=1e-4):
        raise ConversionError("this model version's XL sinusoidal encoding differs from the authors' (interleaved "
                              "sin/cos), so pos_to_pk cannot be copied; the converter needs updating")


# ----------------------------------------------------------------------------------------------- run arguments
_AUTHORS_DEFAULTS: dict[str, Any] = {  # the training code's registered defaults for every argument read here
    "transformer.head_projection_size": None, "transformer.activation": "relu", "transformer.ln_affine": True,
    "transformer.attention_dropout": 0.0, "dropout": 0.0, "embedding_size": None, "tied_embedding": False,
    "moe.att.enable": False, "moe.att.variant": "moa", "moe.att.n_experts": 4, "moe.att.k": 2,
    "moe.att.q_expert": True, "moe.att.k_expert": True, "moe.att.v_expert": True, "moe.att.o_expert": True,
    "moe.att.selection_mode": "sigmoid", "moe.att.shared_experts": False, "moe.att.same_sel": False,
    "moe.att.norm_ret": False, "moe.att.v_size": None, "moe.att.qside_n_experts": None,
    "moe.att.kq_n_experts": None, "moe.att.separate_kq_sel": False, "moe.att.drop_expert": None,
    "moe.drop_expert": 0.0, "rope.rotate_fraction": 0.5, "rope.base": 10000.0,
    "moe.n_experts": 128, "moe.expert_size": 128, "pkm.n_heads": 1, "moe.selection_mode": "sigmoid",
    "moe.perplexity_reg": 0.0, "moe.reg_type": "entropy", "moe.activation_after_topk": False,
    "moe.sel_norm": "none", "moe.norm_keys": False, "moe.topk_mode": "full",
    "lm.trafo.context_blocks": 1, "lm.trafo.last_layer_context": False, "lm.unroll": None,
}
# Settings that change the architecture away from the paper's SwitchHead: only this value converts.
_REQUIRED = {
    "moe.att.q_expert": False, "moe.att.k_expert": False, "moe.att.v_expert": True, "moe.att.o_expert": True,
    "moe.att.selection_mode": "sigmoid", "moe.att.shared_experts": False, "moe.att.same_sel": False,
    "moe.att.norm_ret": False, "moe.att.v_size": None, "moe.att.qside_n_experts": None,
    "moe.att.kq_n_experts": None, "moe.att.separate_kq_sel": False, "embedding_size": None,
    "tied_embedding": False, "lm.trafo.last_layer_context": False,
}
_REQUIRED_SIGMA_MOE = {
    "moe.selection_mode": "sigmoid", "moe.activation_after_topk": False, "moe.sel_norm": "none",
    "moe.norm_keys": False, "moe.topk_mode": "full", "transformer.ln_affine": True,
}
_KEPT_FROM_STORED_CONFIG = ("max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "init_scale",
                            "initializer_range", "use_cache", "output_router_logits", "xl_memory_length")


def _normalise(name: str, value: Any) -> Any:
    """Values as the training code parses them: 'none' -> None, 0/1 -> bools for flags, numeric strings -> numbers."""
    if isinstance(value, str) and not isinstance(_AUTHORS_DEFAULTS.get(name), str):  # choices stay strings
        if value.lower() == "none":
            return None
        if re.fullmatch(r"-?\d+", value):
            return int(value)
        if re.fullmatch(r"-?(\d+\.\d*|\.\d+|\d+)(e-?\d+)?", value):
            return float(value)
    if isinstance(_AUTHORS_DEFAULTS.get(name), bool) and isinstance(value, int):
        return bool(value)
    return value


def _read_args(args: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise ConversionError("run_invariants['args'] must be the run's flat argument dict")
    for name in ("state_size", "transformer.n_heads", "transformer.encoder_n_layers", "transformer.variant"):
        if name not in args:
            raise ConversionError(f"run_invariants['args'] lacks {name!r}, which the architecture needs")
    merged = dict(_AUTHORS_DEFAULTS)
    merged.update(args)
    return {name: _normalise(name, value) for name, value in merged.items()}


def config_from_authors_args(args: dict[str, Any], vocab_size: int, intermediate_size: int | None = None,
                             stored_config: dict[str, Any] | None = None) -> SwitchHeadConfig:
    """Our config for a training-code run: sizes, heads, experts, k, head width, positions and MoE MLP settings.

    `intermediate_size` (the dense MLP width, read from `linear1`) defaults to the training code's
    `int(state_size * transformer.ff_multiplier)`. `stored_config` (written by our exporter) restores what the
    run arguments cannot hold (token ids, ...).
    """
    a = _read_args(args)
    variant = a["transformer.variant"]
    switchall = variant == "preln_moe" and a["moe.att.enable"]
    if variant != "preln_moeatt" and not switchall:
        raise ConversionError(
            f"transformer.variant={variant!r} (moe.att.enable={a['moe.att.enable']}) is not supported: conversion "
            f"handles the pre-LN SwitchHead ('preln_moeatt') and SwitchAll ('preln_moe' with moe.att.enable=1) runs"
        )
    if a["moe.att.variant"] not in ("full", "full_rope"):
        raise ConversionError(f"moe.att.variant={a['moe.att.variant']!r} is not supported; SwitchHead is 'full' "
                              f"(Transformer-XL) or 'full_rope' (RoPE)")
    required = dict(_REQUIRED, **(_REQUIRED_SIGMA_MOE if switchall else {}))
    for name, value in required.items():
        if a[name] != value:
            raise ConversionError(f"{name}={a[name]!r} changes the architecture away from SwitchHead/SwitchAll; "
                                  f"only {name}={value!r} converts")
    if a["transformer.activation"] not in ("relu", "gelu"):
        raise ConversionError(f"transformer.activation={a['transformer.activation']!r} is not supported "
                              f"(relu or gelu)")

    d, heads, layers = int(a["state_size"]), int(a["transformer.n_heads"]), int(a["transformer.encoder_n_layers"])
    xl = a["moe.att.variant"] == "full"
    unroll = a["lm.unroll"]
    attention_dropout_expert = a["moe.att.drop_expert"]
    if attention_dropout_expert is None:  # the training code falls back to the MLP's expert dropout
        attention_dropout_expert = a["moe.drop_expert"]
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
        head_dim=a["transformer.head_projection_size"] or d // heads, attention_type="switchhead",
        num_attention_experts=int(a["moe.att.n_experts"]), num_attention_experts_per_tok=int(a["moe.att.k"]),
        attention_expert_dropout=float(attention_dropout_expert),
        position_encoding="xl" if xl else "rope", hidden_act=a["transformer.activation"],
        hidden_dropout=float(a["dropout"]), attention_dropout=float(a["transformer.attention_dropout"]),
        layer_norm_eps=1e-5, mlp_bias=True, lm_head_bias=True, tie_word_embeddings=False,
    )
    if unroll:
        fields["max_position_embeddings"] = int(unroll)
        if xl:  # each XL layer also attends to `context_blocks` previous chunks of `unroll` tokens
            fields["xl_memory_length"] = int(a["lm.trafo.context_blocks"] or 0) * int(unroll)
    if not xl:
        fields.update(partial_rotary_factor=float(a["rope.rotate_fraction"]),
                      rope_parameters={"rope_type": "default", "rope_theta": float(a["rope.base"])})
    if not switchall:
        fields["intermediate_size"] = intermediate_size or int(d * float(a.get("transformer.ff_multiplier", 2.0)))
    if switchall:
        coef = float(a["moe.perplexity_reg"])
        if coef > 0 and a["moe.reg_type"] != "entropy":
            warnings.warn(f"moe.reg_type={a['moe.reg_type']!r} has no equivalent here; entropy_reg_coef set to 0 "
                          f"(this only matters for further training)", stacklevel=2)
            coef = 0.0
        fields.update(mlp_type="sigma_moe", num_mlp_experts=int(a["moe.n_experts"]),
                      mlp_expert_size=int(a["moe.expert_size"]), num_mlp_experts_per_tok=int(a["pkm.n_heads"]),
                      mlp_expert_dropout=float(a["moe.drop_expert"]), entropy_reg_coef=coef)
    for name in _KEPT_FROM_STORED_CONFIG:
        if stored_config and name in stored_config:
            fields[name] = stored_config[name]
    try:
        return SwitchHeadConfig(**fields)
    except ValueError as error:
        raise ConversionError(f"the run arguments give an invalid architecture: {error}") from None


def authors_args_from_config(config: SwitchHeadConfig, intermediate_size: int) -> dict[str, Any]:
    """The training code's flat argument dict that rebuilds `config`'s architecture (refuses what it cannot)."""
    problems = []
    if config.attention_type != "switchhead":
        problems.append("attention_type='dense' (the authors' dense baselines use another layout)")
    if config.layer_norm_eps != 1e-5:
        problems.append(f"layer_norm_eps={config.layer_norm_eps} (the authors' LayerNorms use 1e-5)")
    if not config.mlp_bias or not config.lm_head_bias:
        problems.append("mlp_bias/lm_head_bias=False (the authors' layers have biases)")
    if config.tie_word_embeddings:
        problems.append("tie_word_embeddings=True")
    if config.hidden_act not in ("relu", "gelu"):
        problems.append(f"hidden_act={config.hidden_act!r}")
    if problems:
        raise ConversionError("the authors' training code cannot express " + "; ".join(problems))
    d, xl = config.hidden_size, config.position_encoding == "xl"
    switchall = config.mlp_type == "sigma_moe"
    args: dict[str, Any] = {
        "state_size": d, "transformer.n_heads": config.num_attention_heads,
        "transformer.encoder_n_layers": config.num_hidden_layers,
        "transformer.head_projection_size": config.head_dim,
        "transformer.variant": "preln_moe" if switchall else "preln_moeatt",
        # int(d * multiplier) must give d_ff back: aim at the middle of the integer
        "transformer.ff_multiplier": (intermediate_size + 0.5) / d,
        "transformer.activation": config.hidden_act, "transformer.attention_dropout": config.attention_dropout,
        "transformer.ln_affine": True, "dropout": config.hidden_dropout, "embedding_size": None,
        "tied_embedding": False,
        "moe.att.enable": True, "moe.att.variant": "full" if xl else "full_rope",
        "moe.att.n_experts": config.num_attention_experts, "moe.att.k": config.num_attention_experts_per_tok,
        "moe.att.drop_expert": config.attention_expert_dropout,
        "moe.att.q_expert": False, "moe.att.k_expert": False, "moe.att.v_expert": True, "moe.att.o_expert": True,
        "moe.att.selection_mode": "sigmoid",
        "lm.unroll": config.max_position_embeddings,
        "lm.trafo.context_blocks": (config.xl_memory_length + config.max_position_embeddings - 1)
        // config.max_position_embeddings if xl else 0,
    }
    if not xl:
        args.update({"rope.rotate_fraction": config.partial_rotary_factor,
                     "rope.base": float(config.rope_parameters.get("rope_theta", config.default_theta))})
    if switchall:
        args.update({"moe.n_experts": config.num_mlp_experts, "moe.expert_size": config.mlp_expert_size,
                     "pkm.n_heads": config.num_mlp_experts_per_tok, "moe.drop_expert": config.mlp_expert_dropout,
                     "moe.perplexity_reg": config.entropy_reg_coef, "moe.reg_type": "entropy",
                     "moe.selection_mode": "sigmoid"})
    return args


# ----------------------------------------------------------------------------------------------- training code
def _authors_names(expected: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Our key -> the training code's (newest) key, for every tensor of the model."""
    names = {}
    for key in expected:
        match = _LAYER_KEY.match(key)
        if key in _TOP_LEVEL:
            names[key] = _TOP_LEVEL[key]
        elif match and match.group(2) in _BLOCK:
            names[key] = f"unique_layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
        else:
            raise ConversionError(f"the model has a tensor {key} that the authors' layout has no name for; "
                                  f"the converter needs updating for this model version")
    return names


def _modernise_authors_key(key: str) -> str | None:
    """The newest name of a training-code key (old attention names renamed); None for statistics buffers."""
    parts = key.split(".")
    if parts[-1] in _STATISTICS and "pkm" in parts:
        return None
    match = re.match(r"^(unique_layers\.\d+\.self_attn\.)([a-z_]+?)(\.weight)?$", key)
    if match and match.group(2) in _OLD_ATTENTION_NAMES:
        return match.group(1) + _OLD_ATTENTION_NAMES[match.group(2)]
    return key


def state_dict_from_authors(model_state: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """The training code's `model` state dict -> ours (tensors shared, `pos_to_pk` columns reordered if needed)."""
    expected = expected_shapes(config)
    ours_by_authors = {authors: ours for ours, authors in _authors_names(expected).items()}
    tensors, source_name = {}, {}
    for key, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"the checkpoint's model entry {key} is a {type(tensor).__name__}, not a tensor")
        modern = _modernise_authors_key(key)
        if modern is None:
            continue
        ours = ours_by_authors.get(modern, modern)
        if ours in tensors:
            raise ConversionError(f"the checkpoint holds both {source_name[ours]} and {key} for the same tensor")
        tensors[ours], source_name[ours] = tensor, key
    for ours, authors in _authors_names(expected).items():
        source_name.setdefault(ours, authors)
    check_tensors(tensors, expected, source_name, "the checkpoint's model state dict")
    if config.position_encoding == "xl":
        check_position_encoding(config.hidden_size)
    return tensors


def state_dict_to_authors(state_dict: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> the training code's `model` state dict (newest names, zeroed statistics buffers)."""
    expected = expected_shapes(config)
    check_tensors(state_dict, expected, {}, "the model's state dict")
    names = _authors_names(expected)
    if config.position_encoding == "xl":
        check_position_encoding(config.hidden_size)
    out = {names[key]: t for key, t in state_dict.items()}
    if config.mlp_type == "sigma_moe":  # a persistent buffer of the authors' MoE layer; their strict load needs it
        for i in range(config.num_hidden_layers):
            statistics = torch.zeros(config.num_mlp_experts, config.mlp_expert_size)
            out[f"unique_layers.{i}.pkm.kv_sel_counts_100"] = statistics
    return out


def config_and_state_from_authors_checkpoint(checkpoint: Any) -> tuple[SwitchHeadConfig, dict[str, torch.Tensor]]:
    """A loaded training-code checkpoint (`{"model": ..., "run_invariants": {"args": ...}}`) -> (config, ours)."""
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise ConversionError("not an authors' training checkpoint: expected a dict with a 'model' state dict")
    invariants = checkpoint.get("run_invariants")
    if not isinstance(invariants, dict) or "args" not in invariants:
        raise ConversionError("the checkpoint has no run_invariants['args'], so its architecture is unknown")
    model_state = checkpoint["model"]
    if not isinstance(model_state, dict) or not isinstance(model_state.get("embedding.weight"), torch.Tensor):
        raise ConversionError("the checkpoint's 'model' entry has no embedding.weight tensor")
    linear1 = model_state.get("unique_layers.0.linear1.weight")
    intermediate = int(linear1.shape[0]) if isinstance(linear1, torch.Tensor) and linear1.dim() == 2 else None
    config = config_from_authors_args(invariants["args"], int(model_state["embedding.weight"].shape[0]),
                                      intermediate, invariants.get("switchhead_config"))
    return config, state_dict_from_authors(model_state, config)


def authors_checkpoint(config: SwitchHeadConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Our model as a training-code checkpoint the authors' `TrainingHelper` restores (weights + run args)."""
    return {
        "model": state_dict_to_authors(state_dict, config),
        "run_invariants": {"args": authors_args_from_config(config, config.intermediate_size), "wandb_id": None,
                           "switchhead_config": config.to_dict()},
        "state": {"iter": 0},
    }


# ----------------------------------------------------------------------------------------------- user module
def _template(pattern: str) -> re.Pattern:
    """'blocks.{i}.attn.' -> a regex matching that prefix, capturing the layer index."""
    if pattern.count("{i}") > 1:
        raise ConversionError(f"prefix {pattern!r} may contain '{{i}}' at most once")
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)"))


def parse_renames(entries: list[str] | dict[str, str] | None) -> dict[str, str]:
    """'THEIRS=OURS' prefix pairs (either side may use '{i}' for the layer index) -> dict."""
    if isinstance(entries, dict) or entries is None:
        return dict(entries or {})
    renames = {}
    for entry in entries:
        if entry.count("=") != 1:
            raise ConversionError(f"--map entries look like THEIR_PREFIX=OUR_PREFIX, got {entry!r}")
        theirs, ours = entry.split("=")
        renames[theirs] = ours
    return renames


def _rename(key: str, renames: dict[str, str]) -> str | None:
    """Apply the first prefix rename that matches `key` (longest source prefix first)."""
    for source in sorted(renames, key=len, reverse=True):
        match = _template(source).match(key)
        if match:
            target = renames[source].replace("{i}", match.group(1)) if match.groups() else renames[source]
            return target + key[match.end():]
    return None


def state_dict_from_module(state_dict: dict[str, torch.Tensor], config: SwitchHeadConfig, layer_prefix: str,
                           renames: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A model built around the user-facing SwitchHead module -> our state dict.

    Keys under `layer_prefix` (e.g. 'blocks.{i}.attn.') are that layer's SwitchHead tensors; every other key must
    be covered by a prefix in `renames` (their prefix -> ours, e.g. 'blocks.{i}.ln1.' ->
    'model.layers.{i}.input_layernorm.'). Every tensor of our model must be produced exactly once.
    """
    if "{i}" not in layer_prefix:
        raise ConversionError(f"--layer-prefix must contain '{{i}}' for the layer index, got {layer_prefix!r}")
    attention = _template(layer_prefix)
    names = module_names(config)
    tensors, source_name = {}, {}
    for key, tensor in state_dict.items():
        match = attention.match(key)
        if match:
            rest = key[match.end():]
            if rest not in names:
                kind = "a SwitchHead module" if names is _MODULE else "a one-expert (n_experts=1) SwitchHead module"
                raise ConversionError(f"unknown key {key}: {kind} has {', '.join(names)}")
            ours = f"model.layers.{match.group(1)}.{names[rest]}"
        else:
            ours = _rename(key, renames or {})
            if ours is None:
                raise ConversionError(f"unknown key {key}: it is not under --layer-prefix {layer_prefix!r} and no "
                                      f"--map prefix covers it")
        if ours in tensors:
            raise ConversionError(f"{source_name[ours]} and {key} both map to {ours}")
        tensors[ours], source_name[ours] = tensor, key
    check_tensors(tensors, expected_shapes(config), source_name, "the module state dict")
    if config.position_encoding == "xl":
        check_position_encoding(config.hidden_size)
    return tensors


def state_dict_to_module(state_dict: dict[str, torch.Tensor], config: SwitchHeadConfig, layer_prefix: str,
                         renames: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Our state dict -> the user's model around the SwitchHead module (the inverse of `state_dict_from_module`)."""
    if "{i}" not in layer_prefix:
        raise ConversionError(f"--layer-prefix must contain '{{i}}' for the layer index, got {layer_prefix!r}")
    check_tensors(state_dict, expected_shapes(config), {}, "the model's state dict")
    if config.position_encoding == "xl":
        check_position_encoding(config.hidden_size)
    theirs_by_ours = {ours: theirs for theirs, ours in module_names(config).items()}
    inverse = {ours: theirs for theirs, ours in (renames or {}).items()}
    out = {}
    for key, tensor in state_dict.items():
        match = _LAYER_KEY.match(key)
        if match and match.group(2) in theirs_by_ours:
            theirs = layer_prefix.replace("{i}", match.group(1)) + theirs_by_ours[match.group(2)]
        else:
            theirs = _rename(key, inverse)
            if theirs is None:
                raise ConversionError(f"no --map prefix covers the model's tensor {key}")
        if theirs in out:
            raise ConversionError(f"two tensors of the model map to {theirs}; check the --map prefixes")
        out[theirs] = tensor
    return out


__all__ = [
    "authors_checkpoint", "authors_args_from_config", "authors_sinusoid", "check_tensors",
    "config_and_state_from_authors_checkpoint", "config_from_authors_args", "expected_shapes", "parse_renames",
    "check_position_encoding", "config_fields_from_layers", "module_names", "state_dict_from_authors", "state_dict_from_module", "state_dict_to_authors",
    "state_dict_to_module",
]
