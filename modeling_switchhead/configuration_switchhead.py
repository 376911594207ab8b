# Copyright 2026 The switchhead authors.
"""Configuration of SwitchHead / SwitchAll language models.

SwitchHead (Csordás et al., NeurIPS 2024) replaces the value and output projections of attention with
sigma-gated mixtures of experts, so a layer needs far fewer attention matrices for the same perplexity.
SwitchAll adds sigma-MoE feed-forward layers. This file only describes the architecture; see
`modeling_switchhead.py` for the model itself.

This file imports only `transformers`, so that a saved folder loads with `trust_remote_code=True` on a
machine where the `switchhead` package is not installed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from transformers import PreTrainedConfig

ATTENTION_TYPES = ("switchhead", "dense")
POSITION_ENCODINGS = ("rope", "xl")
MLP_TYPES = ("dense", "sigma_moe")
HIDDEN_ACTS = ("relu", "gelu", "silu")
# which of SwitchHead's value / output projections are mixtures of experts (the paper's Table 6 ablation)
EXPERT_PROJECTIONS = ("value_output", "value", "output")
# where each block's LayerNorms sit: before both branches ("pre"), or MoEUT's "peri" placement (see the class docstring)
LAYERNORM_PLACEMENTS = ("pre", "peri")
# what the routers' entropy regulariser averages over: each block on its own ("layer"), or MoEUT's "group"
ENTROPY_REG_SCOPES = ("layer", "group")
# RoPE types: the paper's, and every scaled type of Transformers' ROPE_INIT_FUNCTIONS, applied to the rotated channels
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class SwitchHeadConfig(PreTrainedConfig):
    r"""Configuration of a SwitchHead / SwitchAll / dense baseline decoder-only language model.

    The architecture follows the paper: pre-LayerNorm blocks, a final LayerNorm, a ReLU feed-forward (dense, or
    sigma-MoE for SwitchAll), and an untied output layer with a bias.

    Args:
        vocab_size: size of the token vocabulary (8000 in the paper's word-level runs, 256 for Enwik8).
        hidden_size: model width `d`.
        num_hidden_layers: number of decoder blocks `L`.
        num_attention_heads: number of attention heads `H` (attention matrices per layer).
        head_dim: per-head width `dh`; defaults to `hidden_size // num_attention_heads`.
        max_position_embeddings: the longest sequence (plus XL memory) the model is meant to see.
        attention_type: `"switchhead"` (MoE value and output projections) or `"dense"` (plain multi-head
            attention, the paper's baseline).
        num_attention_experts: experts per head `E` for the value and output projections.
        num_attention_experts_per_tok: active experts per head `k` (top-k of the sigmoid gate).
        attention_expert_dropout: probability of excluding a (token, head, expert) score from the top-k during
            training.
        attention_expert_projections: only with `attention_type="switchhead"`: which projections are mixtures of
            experts. `"value_output"` (SwitchHead, the default), `"value"` (expert values, a dense ungated output
            projection `o_proj` `[H*dh -> d]`) or `"output"` (a dense value projection `v_proj` `[d -> H*dh]`,
            expert outputs). The paper's ablation (its Table 6); the dense side has no router and no gate.
        attention_output_gate: only with `attention_type="dense"`: scale each head's attention result by a
            sigmoid gate computed from the attending token, `sigmoid(x W_gate^T)` with W_gate `[H, d]`, before the
            output projection. This is the authors' SwitchHead module with one expert per head (E = 1), for the
            paper's ablations. Off by default (the paper's dense baselines have no gate).
        position_encoding: `"rope"` (rotary, partial) or `"xl"` (Transformer-XL relative attention without u/v
            biases).
        partial_rotary_factor: fraction of each head's channels that RoPE rotates (the paper uses 0.5).
        rope_parameters: RoPE settings in the Transformers v5 format; `rope_theta` defaults to 10000. `rope_type`
            "default" is the paper's RoPE; "linear", "dynamic", "yarn", "longrope" and "llama3" scale it as
            Transformers' `ROPE_INIT_FUNCTIONS` do (same keys: `factor`, `original_max_position_embeddings`, ...),
            on the rotated channels only; "dynamic" (and longrope's long factors) follow the longest position of
            each forward. Only with `position_encoding="rope"`. The legacy `rope_scaling` argument is accepted.
        xl_memory_length: number of previous-segment positions each XL layer may attend to (0: no memory). When
            positive, a forward with `use_cache=False` returns `xl_memory` (each layer's last inputs, detached) to
            pass with the next segment; generation uses the KV cache instead.
        mlp_type: `"dense"` (ReLU MLP with biases) or `"sigma_moe"` (SwitchAll's sigma-MoE, no biases).
        intermediate_size: width of the dense MLP (`d_ff`).
        num_mlp_experts: experts of the sigma-MoE MLP.
        mlp_expert_size: width of one sigma-MoE expert.
        num_mlp_experts_per_tok: active sigma-MoE experts per token (the paper uses 4).
        mlp_expert_dropout: sigma-MoE expert dropout (dropped scores are set to 0 before the top-k).
        entropy_reg_coef: weight of the sigma-MoE entropy regulariser added to the training loss.
        attention_dropout: dropout on the attention probabilities.
        hidden_dropout: dropout on each block's residual branches and on the embeddings.
        layer_norm_eps: LayerNorm epsilon.
        hidden_act: activation of the dense MLP and of the sigma-MoE experts.
        mlp_bias: whether the dense MLP's linear layers have biases (they do in the paper).
        lm_head_bias: whether the output layer has a bias (it does in the paper).
        tie_word_embeddings: share input embedding and output layer (the paper does not).
        init_scale: scale of the paper's initialisation; defaults to `sqrt(2 / num_hidden_layers)` (the paper's
            training code).
        output_router_logits: return the selection logits of every router.
        layer_group_size: MoEUT's shared layers (Csordás et al., "MoEUT: Mixture-of-Experts Universal
            Transformers", NeurIPS 2024): the model has `layer_group_size` distinct blocks, applied in order
            `num_hidden_layers / layer_group_size` times with the same weights (application i runs block
            `i % layer_group_size` and owns KV-cache slot i). None (the default): every block is distinct.
        layernorm_placement: `"pre"` (pre-LayerNorm blocks, the default) or MoEUT's `"peri"`: attention's query,
            key and both routers read the normalised stream and its values the raw one; the sigma-MoE router reads
            the normalised stream and its experts the raw one; no dropout on the MLP branch; the residual stream is
            normalised only before the output layer. Needs `mlp_type="sigma_moe"` and RoPE.
        entropy_reg_scope: what the routers' entropy regulariser averages over. `"layer"` (the default): each
            sigma-MoE MLP's router logits over the batch's tokens, summed over blocks, weighted by
            `entropy_reg_coef`. `"group"` (MoEUT): each distinct block's router logits over all its applications
            and one sequence's tokens (per head for attention), the entropy averaged over sequences (and heads)
            and summed over blocks; the MLP's weighted by `entropy_reg_coef`, each attention router's by
            `attention_entropy_reg_coef`; `aux_loss` is then the weighted sum added to the loss.
        attention_entropy_reg_coef: only with `entropy_reg_scope="group"`: weight of the attention routers'
            entropy regulariser (MoEUT uses 0.001).
    """

    model_type = "switchhead"
    # the outputs' cache field, named `cache` from Transformers 5.24 and `past_key_values` before
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    default_theta = 10000.0
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The computed plan (`_computed_tp_plan`) with the entries assigned to this attribute on top."""
        return {**self._computed_tp_plan(), **self.__dict__.get("base_model_tp_plan", {})}

    def _computed_tp_plan(self) -> dict[str, str]:
        """Tensor-parallel plan (`from_pretrained(..., tp_plan="auto")`), exact for every configuration.

        Attention is split by heads: each process owns whole heads. q_proj / k_proj (and XL's position_key_proj,
        the dense v_proj) colwise, the dense o_proj rowwise (one all-reduce). SwitchHead's per-head tensors, the
        value / output experts `[H*E, d, dh]` / `[H*E, dh, d]` and the routers W_S / W_D `[H*E, d]` (and the
        dense baseline's output gate `[H, d]`), take "switchhead_heads" (modeling file): split along their first
        dim, which is grouped by head, so a head's top-k runs on the process that owns it, and the output experts'
        partial sum over heads is all-reduced (the value-only / output-only ablations: their dense side v_proj
        colwise or o_proj rowwise). Feed-forward: the dense one up_proj colwise, down_proj rowwise; the
        sigma-MoE one is split along each expert's hidden size S (exact for an element-wise activation:
        `act(x K[:, S_r]) V[S_r, :]` summed over the processes' slices S_r), with its router replicated so the
        top-k stays global: `expert_keys` `[E, d, S]` on its last dim ("rowwise"'s placement), `expert_values`
        `[E, S, d]` on dim 1 ("colwise"'s), and the experts module (`mlp.experts`, called after the router)
        Transformers' "moe_tp_experts". The causal LM adds `lm_head`
        (`colwise_gather_output`) and Transformers adds `embed_tokens` (`embedding_rowwise`).
        """
        attention = "layers.*.self_attn"
        plan = {f"{attention}.q_proj": "colwise", f"{attention}.k_proj": "colwise"}
        if self.position_encoding == "xl":
            plan[f"{attention}.position_key_proj"] = "colwise"
        if self.attention_type == "dense":
            plan.update({f"{attention}.v_proj": "colwise", f"{attention}.o_proj": "rowwise"})
            if self.attention_output_gate:
                plan[attention] = "switchhead_heads"  # the output gate [H, d]
        else:
            projections = self.attention_expert_projections
            plan[attention] = "switchhead_heads"  # value_experts / output_experts
            if projections in ("value_output", "value"):
                plan[f"{attention}.value_selection"] = "switchhead_heads"
            else:
                plan[f"{attention}.v_proj"] = "colwise"
            if projections in ("value_output", "output"):
                plan[f"{attention}.output_selection"] = "switchhead_heads"
            else:
                plan[f"{attention}.o_proj"] = "rowwise"
        if self.mlp_type == "dense":
            plan.update({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
        else:
            plan.update({"layers.*.mlp.experts.expert_keys": "rowwise",
                         "layers.*.mlp.experts.expert_values": "colwise",
                         "layers.*.mlp.experts": "moe_tp_experts"})
        return plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str] | None) -> None:
        """Entries assigned here override or extend the computed plan (Transformers 5.17's `__post_init__` assigns
        the plan plus `embed_tokens` for tied embeddings). Kept in the instance dict under the same name, which
        `to_dict` drops, so it is never written to config.json."""
        computed = self._computed_tp_plan()
        self.__dict__["base_model_tp_plan"] = {k: v for k, v in (plan or {}).items() if computed.get(k) != v}

    @property
    def base_model_ep_plan(self) -> dict[str, str]:
        """Expert-parallel plan (`DistributedConfig(ep_size=...)`): the sigma-MoE experts, whole experts per process.

        `expert_keys` `[E, d, S]` and `expert_values` `[E, S, d]` are split along the expert dim ("grouped_gemm"),
        and `mlp.experts` takes "ep_dispatch_experts": the router (`mlp.gate`) stays whole on every process, so each
        token's sigma gates, top-k and router logits (the entropy regulariser's input) are the ones of one process;
        Transformers' dispatch sends each (token, expert) pair to the process that holds the expert and brings the
        gated outputs back. Attention is not expert-parallel (its experts are split by head under `tp_size`): a
        model without a sigma-MoE MLP has no expert-parallel plan, and a plan naming attention is refused
        (`tensor_parallel.check_plans`)."""
        if self.mlp_type != "sigma_moe":
            return {}
        experts = "layers.*.mlp.experts"
        return {f"{experts}.expert_keys": "grouped_gemm", f"{experts}.expert_values": "grouped_gemm",
                experts: "ep_dispatch_experts"}

    vocab_size: int = 8000
    hidden_size: int = 412
    num_hidden_layers: int = 16
    num_attention_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    attention_type: str = "switchhead"
    num_attention_experts: int = 5
    num_attention_experts_per_tok: int = 2
    attention_expert_dropout: float = 0.0
    attention_expert_projections: str = "value_output"
    attention_output_gate: bool = False
    position_encoding: str = "rope"
    partial_rotary_factor: float = 0.5
    rope_parameters: dict | None = None
    xl_memory_length: int = 0
    mlp_type: str = "dense"
    intermediate_size: int = 2080
    num_mlp_experts: int = 16
    mlp_expert_size: int = 128
    num_mlp_experts_per_tok: int = 4
    mlp_expert_dropout: float = 0.0
    entropy_reg_coef: float = 0.0001
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    hidden_act: str = "relu"
    mlp_bias: bool = True
    lm_head_bias: bool = True
    tie_word_embeddings: bool = False
    init_scale: float | None = None
    initializer_range: float = 0.02
    use_cache: bool = True
    output_router_logits: bool = False
    layer_group_size: int | None = None
    layernorm_placement: str = "pre"
    entropy_reg_scope: str = "layer"
    attention_entropy_reg_coef: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            if self.num_attention_heads > 0:
                if self.hidden_size % self.num_attention_heads:
                    raise ValueError(
                        f"head_dim: hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                        f"({self.num_attention_heads}); set head_dim explicitly or change one of them"
                    )
                self.head_dim = self.hidden_size // self.num_attention_heads
        if self.init_scale is None and isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
            self.init_scale = math.sqrt(2.0 / self.num_hidden_layers)
        legacy_scaling = kwargs.pop("rope_scaling", None)  # the pre-v5 name of rope_parameters
        if legacy_scaling and self.rope_parameters is None:
            self.rope_parameters = dict(legacy_scaling)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", self.default_theta)}
        _check_config(self)
        super().__post_init__(**kwargs)

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def num_rotary_channels(self) -> int:
        """Channels of each head that RoPE rotates (the first ones): `int(partial_rotary_factor * head_dim)`,
        rounded down to even because RoPE rotates channel pairs (so the default 412 / 2 heads, dh=206, rotates 102).
        """
        return int(self.partial_rotary_factor * self.head_dim) // 2 * 2

    @property
    def num_layer_groups(self) -> int:
        """How many times the distinct blocks are applied: `num_hidden_layers / layer_group_size` (1 without
        shared layers)."""
        return self.num_hidden_layers // (self.layer_group_size or self.num_hidden_layers)

    @property
    def num_distinct_layers(self) -> int:
        """The blocks that have weights of their own: `layer_group_size`, or `num_hidden_layers` without sharing."""
        return self.layer_group_size or self.num_hidden_layers

    @property
    def routers_per_layer(self) -> int:
        """How many expert routers one block has: value and/or output selection, plus the sigma-MoE one."""
        return len(self.attention_expert_routers) + (1 if self.mlp_type == "sigma_moe" else 0)

    @property
    def attention_expert_routers(self) -> tuple[str, ...]:
        """The attention projections that are mixtures of experts, in the order a block records their routers."""
        if self.attention_type != "switchhead":
            return ()
        return {"value_output": ("value", "output"), "value": ("value",), "output": ("output",)}[
            self.attention_expert_projections]

    @classmethod
    def preset_names(cls) -> list[str]:
        return sorted(PRESETS)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "SwitchHeadConfig":
        """A preset by name: a configuration of the paper or a tiny CPU one; `preset_names()` lists them."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
        fields = copy.deepcopy(PRESETS[name])
        fields.update(overrides)
        return cls(**fields)


# ----------------------------------------------------------------------------------------------- validation
# One table of per-field rules, the rules that relate fields as named checks, and `_check_config` to run them,
# every field first. Not huggingface_hub's `@strict` field validators (which Transformers 5.x configs use): they run
# at each assignment, before `__post_init__` derives head_dim and init_scale, and they raise
# StrictDataclassFieldValidationError, not a ValueError, around the message.
def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    """isinstance, where a bool counts only if `types` names bool (True is no integer or number here)."""
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


class _Rule(NamedTuple):
    """A field accepts a value of one of `types` for which `accepts` holds. The messages, for a wrong type and for a
    value out of range, are formatted with the field's `name` and `value`."""

    types: tuple[type, ...]
    accepts: Callable[[Any], bool]
    wrong_type: str
    out_of_range: str


def _integer(minimum: int) -> _Rule:
    return _Rule((int,), lambda value: value >= minimum, "{name} must be an integer, got {value!r}",
                 f"{{name}} ({{value}}) must be >= {minimum}")


def _finite_number(accepts: Callable[[float], bool], description: str) -> _Rule:
    message = f"{{name}} must be a finite {description}, got {{value!r}}"
    return _Rule((int, float), lambda value: math.isfinite(value) and accepts(value), message, message)


def _choice(options: tuple[str, ...]) -> _Rule:
    message = f"{{name}} must be one of {', '.join(map(repr, options))}, got {{value!r}}"
    return _Rule((str,), lambda value: value in options, message, message)


_PROBABILITY = _Rule((int, float), lambda value: 0.0 <= value < 1.0,
                     "{name} must be a number in [0, 1), got {value!r}", "{name} ({value}) must be in [0, 1)")
_FLAG = _Rule((bool,), lambda value: True, "{name} must be True or False, got {value!r}", "")

# field -> rule, checked in this order; pad/bos/eos_token_id depend on vocab_size, so they are a named check
_FIELD_RULES: dict[str, _Rule] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "max_position_embeddings", "intermediate_size", "num_attention_experts",
                     "num_attention_experts_per_tok", "num_mlp_experts", "mlp_expert_size",
                     "num_mlp_experts_per_tok"), _integer(1)),
    "xl_memory_length": _integer(0),
    **dict.fromkeys(("attention_expert_dropout", "mlp_expert_dropout", "attention_dropout", "hidden_dropout"),
                    _PROBABILITY),
    "attention_type": _choice(ATTENTION_TYPES),
    "attention_expert_projections": _choice(EXPERT_PROJECTIONS),
    "attention_output_gate": _FLAG,
    "position_encoding": _choice(POSITION_ENCODINGS),
    "mlp_type": _choice(MLP_TYPES),
    "hidden_act": _choice(HIDDEN_ACTS),
    "partial_rotary_factor": _Rule((int, float), lambda value: 0.0 < value <= 1.0,
                                   "{name} must be a number in (0, 1], got {value!r}",
                                   "{name} ({value}) must be in (0, 1]"),
    "rope_parameters": _Rule((dict,), lambda value: True, "{name} must be a dict, got {value!r}", ""),
    **dict.fromkeys(("layer_norm_eps", "init_scale", "initializer_range"),
                    _finite_number(lambda value: value > 0, "positive number")),
    **dict.fromkeys(("entropy_reg_coef", "attention_entropy_reg_coef"),
                    _finite_number(lambda value: value >= 0, "number >= 0")),
    "layer_group_size": _Rule((int, type(None)), lambda value: value is None or value >= 1,
                              "{name} must be None or an integer, got {value!r}", "{name} ({value}) must be >= 1"),
    "layernorm_placement": _choice(LAYERNORM_PLACEMENTS),
    "entropy_reg_scope": _choice(ENTROPY_REG_SCOPES),
    **dict.fromkeys(("mlp_bias", "lm_head_bias", "tie_word_embeddings", "use_cache", "output_router_logits"), _FLAG),
}


class _RopeNumber(NamedTuple):
    """A numeric key of `rope_parameters`: its lower bound, whether the bound is excluded, whether it is required."""

    minimum: float
    exclusive: bool = False
    required: bool = False


# the numeric keys each scaled rope_type reads (as Transformers' ROPE_INIT_FUNCTIONS do), checked in this order;
# an optional key that is absent or None takes Transformers' default
_ROPE_NUMBERS: dict[str, dict[str, _RopeNumber]] = {
    "linear": {"factor": _RopeNumber(1.0, required=True)},
    "dynamic": {"factor": _RopeNumber(1.0, required=True)},
    "yarn": {"factor": _RopeNumber(1.0, required=True), "beta_fast": _RopeNumber(0.0), "beta_slow": _RopeNumber(0.0),
             "mscale": _RopeNumber(0.0), "mscale_all_dim": _RopeNumber(0.0),
             "attention_factor": _RopeNumber(0.0, exclusive=True)},
    "llama3": {"factor": _RopeNumber(1.0, required=True),
               "low_freq_factor": _RopeNumber(0.0, exclusive=True, required=True),
               "high_freq_factor": _RopeNumber(0.0, exclusive=True, required=True)},
    "longrope": {"factor": _RopeNumber(1.0), "attention_factor": _RopeNumber(0.0, exclusive=True)},
}


def _expert_projections_need_switchhead(config: SwitchHeadConfig) -> None:
    if config.attention_expert_projections != "value_output" and config.attention_type != "switchhead":
        raise ValueError(f"attention_expert_projections={config.attention_expert_projections!r} needs "
                         f"attention_type='switchhead', got {config.attention_type!r}")


def _output_gate_needs_dense_attention(config: SwitchHeadConfig) -> None:
    if config.attention_output_gate and config.attention_type != "dense":
        raise ValueError(
            f"attention_output_gate=True needs attention_type='dense' (it is SwitchHead with one expert per "
            f"head), got {config.attention_type!r}; SwitchHead attention already gates its output experts"
        )


def _experts_per_token_within_experts(config: SwitchHeadConfig) -> None:
    for per_token, experts in (("num_attention_experts_per_tok", "num_attention_experts"),
                               ("num_mlp_experts_per_tok", "num_mlp_experts")):
        if getattr(config, per_token) > getattr(config, experts):
            raise ValueError(f"{per_token} ({getattr(config, per_token)}) must be <= {experts} "
                             f"({getattr(config, experts)})")


def _xl_memory_needs_xl_positions(config: SwitchHeadConfig) -> None:
    if config.xl_memory_length > 0 and config.position_encoding != "xl":
        raise ValueError(f"xl_memory_length ({config.xl_memory_length}) needs position_encoding='xl', "
                         f"got {config.position_encoding!r}")


def _rope_rotates_a_channel_pair(config: SwitchHeadConfig) -> None:
    if config.position_encoding == "rope" and config.num_rotary_channels < 2:
        raise ValueError(f"partial_rotary_factor ({config.partial_rotary_factor}) times head_dim ({config.head_dim}) "
                         f"gives {config.num_rotary_channels} rotary channels; RoPE needs at least 2")


def _rope_parameters_fit(config: SwitchHeadConfig) -> None:
    """rope_theta, the rope_type and the keys that type needs.

    Scaled RoPE (every type of Transformers' `ROPE_INIT_FUNCTIONS` but "proportional") acts on the rotated
    channels only, so lengths and factors are checked against `num_rotary_channels`, not head_dim.
    """
    params = config.rope_parameters
    theta = params.get("rope_theta", config.default_theta)
    if not _has_type(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_parameters['rope_theta'] must be a finite positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters['rope_type'] must be one of {', '.join(map(repr, ROPE_TYPES))}, got {rope_type!r}"
            + (" ('proportional' is a partial-RoPE scheme of its own; use partial_rotary_factor instead)"
               if rope_type == "proportional" else "")
        )
    if rope_type == "default":
        return
    if config.position_encoding != "rope":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} needs position_encoding='rope'; this config uses "
            f"position_encoding={config.position_encoding!r} (Transformer-XL relative positions, no RoPE to "
            f"scale): drop the RoPE scaling from rope_parameters or use position_encoding='rope'"
        )
    prf = params.get("partial_rotary_factor", config.partial_rotary_factor)
    if prf != config.partial_rotary_factor:
        raise ValueError(f"rope_parameters['partial_rotary_factor'] ({prf!r}) differs from partial_rotary_factor "
                         f"({config.partial_rotary_factor!r}); set only the partial_rotary_factor field")
    original = params.get("original_max_position_embeddings")
    if original is not None and (not _has_type(original, (int,)) or original < 1):
        raise ValueError(f"rope_parameters['original_max_position_embeddings'] must be a positive integer (the "
                         f"context the model was trained with), got {original!r}")
    for key, rule in _ROPE_NUMBERS[rope_type].items():
        value, bound = params.get(key), f"{'>' if rule.exclusive else '>='} {rule.minimum:g}"
        if value is None and rule.required:
            raise ValueError(f"rope_parameters for rope_type={rope_type!r} needs {key!r} (a number {bound}), "
                             f"got {params!r}")
        if value is not None and (not _has_type(value, (int, float)) or not math.isfinite(value)
                                  or value < rule.minimum or (rule.exclusive and value == rule.minimum)):
            raise ValueError(f"rope_parameters[{key!r}] for rope_type={rope_type!r} must be a finite number "
                             f"{bound}, got {value!r}")
    if rope_type == "dynamic" and config.num_rotary_channels < 4:
        raise ValueError(f"rope_type='dynamic' needs at least 4 rotary channels (its base grows with exponent "
                         f"d / (d - 2)); partial_rotary_factor * head_dim gives {config.num_rotary_channels}")
    # 32 and 1: Transformers' defaults of beta_fast and beta_slow
    if rope_type == "yarn" and (params.get("beta_fast") or 32) < (params.get("beta_slow") or 1):
        raise ValueError(f"rope_parameters['beta_fast'] must be >= beta_slow, got {params!r}")
    if rope_type == "yarn" and not isinstance(params.get("truncate", True), bool):
        raise ValueError(f"rope_parameters['truncate'] must be True or False, got {params['truncate']!r}")
    if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(f"rope_parameters['high_freq_factor'] ({params['high_freq_factor']}) must be greater "
                         f"than low_freq_factor ({params['low_freq_factor']})")
    for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
        value, pairs = params.get(key), config.num_rotary_channels // 2
        if not isinstance(value, (list, tuple)) or len(value) != pairs \
                or not all(_has_type(v, (int, float)) and v > 0 for v in value):
            raise ValueError(
                f"rope_parameters[{key!r}] for rope_type='longrope' must be a list of {pairs} positive numbers "
                f"(one per rotated channel pair: num_rotary_channels={config.num_rotary_channels}), got {value!r}"
            )


def _layer_groups_divide_layers(config: SwitchHeadConfig) -> None:
    """Shared layers: the group of distinct blocks is applied a whole number of times."""
    size = config.layer_group_size
    if size is not None and config.num_hidden_layers % size:
        raise ValueError(f"num_hidden_layers ({config.num_hidden_layers}) must be a multiple of layer_group_size "
                         f"({size}): the group of distinct blocks is applied num_hidden_layers / layer_group_size "
                         f"times")


def _peri_layernorm_needs_sigma_moe_and_rope(config: SwitchHeadConfig) -> None:
    """MoEUT's peri-LayerNorm splits the sigma-MoE router's input from its experts'; XL memory is not defined for
    it."""
    if config.layernorm_placement != "peri":
        return
    if config.mlp_type != "sigma_moe":
        raise ValueError(f"layernorm_placement='peri' needs mlp_type='sigma_moe' (its router reads the normalised "
                         f"stream, its experts the raw one), got {config.mlp_type!r}")
    if config.position_encoding != "rope":
        raise ValueError(f"layernorm_placement='peri' needs position_encoding='rope' (as MoEUT), got "
                         f"{config.position_encoding!r}")


def _attention_entropy_needs_group_scope(config: SwitchHeadConfig) -> None:
    if config.attention_entropy_reg_coef > 0 and config.entropy_reg_scope != "group":
        raise ValueError(f"attention_entropy_reg_coef ({config.attention_entropy_reg_coef}) needs "
                         f"entropy_reg_scope='group' (MoEUT's regulariser); the 'layer' scope regularises only the "
                         f"sigma-MoE MLP")


def _token_ids_in_vocabulary(config: SwitchHeadConfig) -> None:
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name)
        ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]  # eos may list ids
        if value is not None and not all(_has_type(i, (int,)) and 0 <= i < config.vocab_size for i in ids):
            raise ValueError(f"{name} must be None or a token id in [0, vocab_size={config.vocab_size}), "
                             f"got {value!r}")


# the rules that relate fields, checked in this order once every field has passed its own rule
_CROSS_FIELD_CHECKS = (_expert_projections_need_switchhead, _output_gate_needs_dense_attention,
                       _experts_per_token_within_experts, _xl_memory_needs_xl_positions, _rope_rotates_a_channel_pair,
                       _rope_parameters_fit, _layer_groups_divide_layers, _peri_layernorm_needs_sigma_moe_and_rope,
                       _attention_entropy_needs_group_scope, _token_ids_in_vocabulary)


def _check_config(config: SwitchHeadConfig) -> None:
    """Raise ValueError naming the field and the rule for the first invalid setting."""
    for name, rule in _FIELD_RULES.items():
        value = getattr(config, name)
        if not _has_type(value, rule.types):
            raise ValueError(rule.wrong_type.format(name=name, value=value))
        if not rule.accepts(value):
            raise ValueError(rule.out_of_range.format(name=name, value=value))
    for check in _CROSS_FIELD_CHECKS:
        check(config)


# -------------------------------------------------------------------------------------------------- presets
def _paper(d, layers, heads, experts, k, dh, d_ff, context, dropout, *, position="xl", vocab=8000,
           attention="switchhead", mlp=None, entropy=0.0001):
    fields = dict(
        vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, head_dim=dh,
        max_position_embeddings=context, attention_type=attention, position_encoding=position,
        hidden_dropout=dropout, intermediate_size=d_ff or 4 * d,
        xl_memory_length=context if position == "xl" else 0,
    )
    if attention == "switchhead":
        fields.update(num_attention_experts=experts, num_attention_experts_per_tok=k)
    if mlp is not None:
        n_experts, size = mlp
        fields.update(mlp_type="sigma_moe", num_mlp_experts=n_experts, mlp_expert_size=size,
                      num_mlp_experts_per_tok=4, entropy_reg_coef=entropy)
    return fields


def _moeut(d, layers, heads, mlp_experts, attention_experts, dh, mlp_k, group):
    """A MoEUT configuration: SwitchHead attention (k=2) with RoPE and sigma-MoE MLP (expert size 128), shared layers
    in groups of `group`, peri-LayerNorm, the group-wide entropy regulariser (0.01 MLP, 0.001 attention: the
    authors' module's defaults), no dropout, the paper's 8000-token vocabulary and 1024-token context."""
    return dict(
        vocab_size=8000, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads, head_dim=dh,
        max_position_embeddings=1024, attention_type="switchhead", position_encoding="rope",
        num_attention_experts=attention_experts, num_attention_experts_per_tok=2, mlp_type="sigma_moe",
        num_mlp_experts=mlp_experts, mlp_expert_size=128, num_mlp_experts_per_tok=mlp_k, hidden_dropout=0.0,
        layer_group_size=group, layernorm_placement="peri", entropy_reg_scope="group", entropy_reg_coef=0.01,
        attention_entropy_reg_coef=0.001,
    )


PRESETS: dict[str, dict[str, Any]] = {
    # SwitchHead, Transformer-XL attention (the paper's configurations)
    "c4-47m-switchhead-xl": _paper(412, 16, 2, 5, 3, 76, 2080, 256, 0.1),
    "c4-262m-switchhead-xl": _paper(1024, 18, 4, 4, 2, 112, 4188, 512, 0.2),
    "wt103-47m-switchhead-xl": _paper(412, 16, 2, 5, 2, 76, 2080, 256, 0.1),
    "wt103-262m-switchhead-xl": _paper(1024, 18, 2, 8, 4, 132, 4147, 512, 0.2),
    "enwik8-41m-switchhead-xl": _paper(512, 12, 2, 4, 2, 112, 2088, 512, 0.1, vocab=256),
    # SwitchHead, RoPE
    "wt103-45m-switchhead-rope": _paper(412, 16, 2, 5, 3, 64, 2092, 512, 0.1, position="rope"),
    "wt103-243m-switchhead-rope": _paper(1024, 18, 4, 4, 2, 100, 4136, 1024, 0.2, position="rope"),
    # SwitchAll: SwitchHead attention + sigma-MoE MLP (16x128 / 32x128, k=4)
    "wt103-47m-switchall-xl": _paper(412, 16, 2, 5, 2, 76, None, 256, 0.1, mlp=(16, 128), entropy=0.0001),
    "c4-47m-switchall-xl": _paper(412, 16, 2, 5, 3, 76, None, 256, 0.1, mlp=(16, 128), entropy=0.0001),
    "pes2o-47m-switchall-xl": _paper(412, 16, 2, 5, 3, 76, None, 256, 0.1, mlp=(16, 128), entropy=0.0001),
    "wt103-259m-switchall-xl": _paper(1024, 18, 4, 4, 2, 112, None, 512, 0.2, mlp=(32, 128), entropy=0.001),
    "c4-259m-switchall-xl": _paper(1024, 18, 4, 4, 2, 112, None, 512, 0.2, mlp=(32, 128), entropy=0.001),
    "pes2o-259m-switchall-xl": _paper(1024, 18, 4, 4, 2, 112, None, 512, 0.2, mlp=(32, 128), entropy=0.001),
    # Dense baselines (Transformer-XL), parameter-matched to the SwitchHead models
    "c4-47m-dense-xl": _paper(412, 16, 10, None, None, 41, 2053, 256, 0.1, attention="dense"),
    "wt103-47m-dense-xl": _paper(412, 16, 10, None, None, 41, 2053, 256, 0.1, attention="dense"),
    "c4-262m-dense-xl": _paper(1024, 18, 16, None, None, 64, 4110, 512, 0.2, attention="dense"),
    "wt103-262m-dense-xl": _paper(1024, 18, 16, None, None, 64, 4110, 512, 0.2, attention="dense"),
    "enwik8-41m-dense-xl": _paper(512, 12, 8, None, None, 64, 2053, 512, 0.1, vocab=256, attention="dense"),
    # Tiny models for CPU tests and demos (minutes on 2 cores)
    "tiny-switchhead": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                            num_attention_experts=4, num_attention_experts_per_tok=2, intermediate_size=128,
                            max_position_embeddings=128, hidden_dropout=0.0),
    "tiny-switchall": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                           num_attention_experts=4, num_attention_experts_per_tok=2, mlp_type="sigma_moe",
                           num_mlp_experts=8, mlp_expert_size=16, num_mlp_experts_per_tok=2, entropy_reg_coef=0.001,
                           max_position_embeddings=128, hidden_dropout=0.0),
    "tiny-dense": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                       attention_type="dense", intermediate_size=128, max_position_embeddings=128,
                       hidden_dropout=0.0),
    "tiny-switchhead-xl": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                               head_dim=16, num_attention_experts=4, num_attention_experts_per_tok=2,
                               intermediate_size=128, position_encoding="xl", max_position_embeddings=128,
                               hidden_dropout=0.0),
    # MoEUT (Csordás et al., NeurIPS 2024): the authors' profiles.py (d_model, n_layers, n_heads, ff_n_experts,
    # att_n_experts, d_head, ff_k, group_size) with their module's defaults for the rest. The 727M one is the paper's
    # run of that name (their sweeps/c4_moeut_gigantic_switchead.yaml: d_model 1280, 727.4M parameters); profiles.py's
    # MoEUT_727M has d_model 1024, which builds 582M (conversion/moeut_format.py converts that profile as written).
    "moeut-44m": _moeut(412, 16, 4, 155, 8, 82, 12, 2),
    "moeut-126m": _moeut(768, 18, 4, 254, 10, 96, 12, 2),
    "moeut-244m": _moeut(1024, 18, 4, 387, 10, 128, 16, 2),
    "moeut-318m": _moeut(1024, 24, 4, 338, 10, 128, 16, 3),
    "moeut-727m": _moeut(1280, 36, 5, 467, 13, 128, 20, 4),
    "moeut-1b": _moeut(1536, 36, 6, 565, 12, 128, 24, 4),
    "tiny-moeut": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=16,
                       num_attention_experts=4, num_attention_experts_per_tok=2, mlp_type="sigma_moe",
                       num_mlp_experts=8, mlp_expert_size=16, num_mlp_experts_per_tok=2, max_position_embeddings=128,
                       hidden_dropout=0.0, layer_group_size=2, layernorm_placement="peri", entropy_reg_scope="group",
                       entropy_reg_coef=0.01, attention_entropy_reg_coef=0.001),
    "tiny-dense-xl": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                          attention_type="dense", intermediate_size=128, position_encoding="xl",
                          max_position_embeddings=128, hidden_dropout=0.0),
}

__all__ = ["SwitchHeadConfig", "PRESETS"]
