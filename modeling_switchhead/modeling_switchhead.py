"""SwitchHead and SwitchAll language models for Hugging Face Transformers.

SwitchHead ("SwitchHead: Accelerating Transformers with Mixture-of-Experts Attention", Csordás,
Piękos, Irie, Schmidhuber, NeurIPS 2024) keeps the query and key projections of each head dense and
turns its value and output projections into sigma-gated mixtures of experts:

    s_S = sigmoid(x_src W_S^T)  per head, top-k                      (value side, from the attended-to token)
    s_D = sigmoid(x_dst W_D^T)  per head, top-k                      (output side, from the attending token)
    V_h = sum_{e in topk(s_S, h)} s_S[h, e] * x W_V[h, e]
    A_h = softmax(Q_h K_h^T / sqrt(dh))                              (causal)
    y   = sum_h sum_{e in topk(s_D, h)} s_D[h, e] * (A_h V_h) W_O[h, e]

so a layer with few heads (and few attention matrices) matches a dense model with many. SwitchAll
also replaces the feed-forward block by a sigma-MoE. `attention_type="dense"` gives the paper's
multi-head baseline.

The file is Hub-ready: it imports only torch, transformers and its sibling files, which a saved folder carries too
(the expert projections and their Transformers registration, the routers, positions, parallel styles,
checkpoint names, and what differs between Transformers releases).
"""

# No `from __future__ import annotations` here: Transformers reads the `**kwargs: Unpack[TransformersKwargs]`
# annotations at run time (e.g. to know that forward accepts output_attentions), which needs real objects.
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .transformers_compat import (  # first: it checks the installed Transformers release
    accepts_past_key_values,
    incompatible_release,
    install_output_hooks,
    model_cache,
    output_cache,
    sdpa_head_padding,
    transformers_cache,
    update_cache,
)

try:
    from transformers import AutoModel
    from transformers import initialization as init
    from transformers.cache_utils import Cache
    from transformers.generation import GenerationMixin
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import GenericForQuestionAnswering, GenericForSequenceClassification
    from transformers.modeling_layers import GenericForTokenClassification, GradientCheckpointingLayer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
    from transformers.processing_utils import Unpack
    from transformers.utils import TransformersKwargs, can_return_tuple
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError as error:  # a release too old (or too new) for this file: say which to install
    raise incompatible_release(error) from error

from .checkpoint_format import SavedFolderMixin, register_renamed_keys
from .configuration_switchhead import SwitchHeadConfig
from .model_io import SwitchHeadCausalLMOutputWithPast, SwitchHeadModelOutputWithPast, check_inputs, embed_tokens
from .expert_ops import (EXPERTS_IMPLEMENTATIONS, autocast_input, fused_attention_inputs, fuses_attention_block, lookup,
                         relu, shared_autocast_inputs)
from .experts_integration import ExpertsChoiceMixin, configured_implementation, local_routes
from .experts_integration import register as register_experts_functions
from .routing import ExpertSelection, group_entropy_loss, mlp_router_logits, regularised, sigma_moe_entropy_loss
from .tensor_parallel import ParallelPlansMixin, register_styles
from .positions import (SwitchHeadRotaryEmbedding, apply_partial_rotary, check_xl_memory, create_xl_memory_mask,
                        rotary_embedding, xl_attention_inputs)


# ======================================================================================== attention
def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: query `[B, H, Tq, dh]`, key/value `[B, H, Tk, dh]` -> (`[B, Tq, H, dh]`, probs)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    elif query.shape[2] > 1:  # no mask given: plain causal, queries aligned to the end of the keys
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
        causal = causal.tril(key.shape[2] - query.shape[2])
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class SwitchHeadAttentionBase(nn.Module):
    """What SwitchHead and dense attention share: dense per-head Q/K, positions, cache and attention backend.
    Subclasses say how values are made (`project_values`, or all inputs at once: `project_inputs`) and how the heads'
    results become the output (`project_output`).

    `config._attn_implementation` picks eager (`eager_attention_forward`, the reference), sdpa or flex. XL's
    relative-position term (`positions.xl_position_bias`, `[B, H, Tq, Tk]`) goes in as `position_bias`; keys are cache
    or XL memory first, then the current tokens (query t at key index `query_offset + t`). On purpose unlike the
    authors' code: attention dropout acts on the probabilities (the paper's runs use 0), and the dense XL baseline
    has no u/v biases and a fixed 1/sqrt(dh) scale.
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.num_key_value_groups = 1
        self.attention_dropout = config.attention_dropout
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.position_encoding = config.position_encoding
        if self.position_encoding == "xl":
            # W_pk: projects the sinusoidal encoding of the relative position into each head's key space.
            self.position_key_proj = nn.Linear(config.hidden_size, inner, bias=False)

    def project_inputs(self, hidden_states: torch.Tensor, sources: torch.Tensor) -> tuple:
        """hidden_states `[B, T, d]`, sources `[B, M + T, d]` -> query `[B, T, H, dh]`, key and value
        `[B, M + T, H, dh]`, and what `project_output` takes besides (here None)."""
        batch, length, _ = hidden_states.shape
        query = _linear(self.q_proj, hidden_states).view(batch, length, -1, self.head_dim)
        key = _linear(self.k_proj, sources).view(batch, sources.shape[1], -1, self.head_dim)
        return query, key, self.project_values(sources), None

    def project_values(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `[B, T, d]` -> values `[B, T, H, dh]`."""
        raise NotImplementedError

    def project_output(self, attended: torch.Tensor, hidden_states: torch.Tensor, routing=None) -> torch.Tensor:
        """attended `[B, T, H, dh]`, hidden_states `[B, T, d]` (the destination tokens) -> `[B, T, d]`."""
        raise NotImplementedError

    # Under autocast, whether the projections read one low-precision copy of each input (SwitchHead: its q, k,
    # values and both routers read the layer's input and XL's sources) instead of one per projection, as autocast
    # makes them (`expert_ops.shared_autocast_inputs`; the same outputs and gradients, fewer bytes kept)
    shares_autocast_inputs = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        memory: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states `[B, T, d]` (normalised); memory `[B, M, d]` (normalised XL memory, or None) -> `[B, T, d]`.

        Memory tokens are extra sources: they give keys and (expert-mixed) values, never queries.
        """
        if not self.shares_autocast_inputs:
            return self._attend(hidden_states, position_embeddings, attention_mask, cache, memory, **kwargs)
        with shared_autocast_inputs(hidden_states):
            return self._attend(hidden_states, position_embeddings, attention_mask, cache, memory, **kwargs)

    def _attend(self, hidden_states, position_embeddings, attention_mask, cache, memory, **kwargs):
        if "past_key_values" in kwargs:  # inside the model the cache has one name; ignoring it would be silent
            raise TypeError("SwitchHead's layers take the key-value cache as `cache=` (the top-level forwards also "
                            "accept `past_key_values=`)")
        batch, length, _ = hidden_states.shape
        heads_shape = (batch, length, -1, self.head_dim)  # -1: this process's heads under tensor parallelism
        sources = hidden_states if memory is None else torch.cat((memory, hidden_states), dim=1)  # [B, M + T, d]
        value_states = kwargs.pop("value_states", None)  # MoEUT's peri-LayerNorm: values from the raw stream
        query, key, value, routing = (self.project_inputs(hidden_states, sources) if value_states is None
                                      else peri_attention_inputs(self, hidden_states, value_states))
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, H, T or M+T, dh]
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query, key = apply_partial_rotary(query, cos, sin), apply_partial_rotary(key, cos, sin)

        # shared layers (MoEUT): the model names this application's cache slot; else the block's own index
        cache_slot = kwargs.pop("cache_layer_idx", self.layer_idx)
        key, value, past_length, packed = update_cache(cache, key, value, cache_slot, kwargs)
        # index of the first query among the keys: what the cache held before, else the memory length
        query_offset = sources.shape[1] - length if past_length is None else past_length

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation or "eager", eager_attention_forward  # None: a layer built alone
        )
        attention_mask, extra = xl_attention_inputs(self, query, key.shape[2], attention_mask, query_offset, packed,
                                                    kwargs, attention_interface)  # XL's position term, if any
        pad = sdpa_head_padding(self.config._attn_implementation, query,
                                attention_mask is not None or "position_bias" in extra)
        if pad:  # to a width sdpa's fused kernels take with a mask (exact: see sdpa_head_padding)
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        # before Transformers 5.24 the paged attention function updates the paged cache (`kwargs["cache"]`) at
        # `module.layer_idx`: a shared block (MoEUT) carries this application's slot for the call
        own_slot = self.layer_idx
        paged_slot = cache_slot != own_slot and packed and kwargs.get("cache") is not None
        if paged_slot:
            self.layer_idx = cache_slot
        try:
            attended, probs = attention_interface(
                self,
                query,
                key,
                value,
                attention_mask,
                dropout=self.attention_dropout if self.training else 0.0,
                scaling=self.scaling,
                **extra,
                **kwargs,
            )  # attended: [B, T, H, dh (+ pad)]
        finally:
            if paged_slot:
                self.layer_idx = own_slot
        if pad:
            attended = attended[..., : self.head_dim]
        # exported, a copy in the standard layout: torch.onnx's decompositions may replace sdpa's CPU kernel (whose
        # transposed output is contiguous already, so `.contiguous()` recorded nothing) by one whose output is not
        if torch.compiler.is_exporting():
            attended = attended.clone(memory_format=torch.contiguous_format)
        return self.project_output(attended.reshape(heads_shape), hidden_states, routing=routing), probs


class SwitchHeadAttention(SwitchHeadAttentionBase):
    """SwitchHead: sigma-MoE value and output projections, E experts per head, k active per head.

    `config.attention_expert_projections` ("value_output", the default) can make only one side a mixture of experts (the
    paper's Table 6 ablation): "value" keeps expert values and uses a dense, ungated output projection `o_proj` (H*dh ->
    d); "output" uses a dense value projection `v_proj` (d -> H*dh) and expert outputs. The dense side has no router.
    """

    is_transposed = True  # expert tensors are [experts, in, out] (Transformers' / PEFT's flag for that layout)
    shares_autocast_inputs = True

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        heads, experts, d = self.num_heads, config.num_attention_experts, config.hidden_size
        self.num_experts = experts
        self.top_k = config.num_attention_experts_per_tok
        projections = getattr(config, "attention_expert_projections", "value_output")
        self.expert_values = projections in ("value_output", "value")
        self.expert_output = projections in ("value_output", "output")
        selection_args = (d, heads, experts, self.top_k, config.attention_expert_dropout, False)
        if self.expert_values:
            self.value_selection = ExpertSelection(*selection_args)  # W_S: source side
        if self.expert_output:
            self.output_selection = ExpertSelection(*selection_args)  # W_D: destination side
        if self.expert_values:
            self.value_experts = nn.Parameter(torch.empty(heads * experts, d, self.head_dim))  # W_V [H*E, d, dh]
        else:
            self.v_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        if self.expert_output:
            self.output_experts = nn.Parameter(torch.empty(heads * experts, self.head_dim, d))  # W_O [H*E, dh, d]
        else:
            self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def project_inputs(self, hidden_states, sources):
        """"switchhead_fused", and "switchhead_auto" training on a GPU (`expert_ops.fuses_attention_block`; both sides
        experts, no XL memory, not split by tensor parallelism): q, k, every expert's values and both routers' logits
        from one GEMM (`expert_ops.fused_attention_inputs`), the values mixed with a recomputing backward; the output
        router's logits go on to `project_output`. Otherwise one projection at a time (under
        tensor parallelism each projection's own style moves its sharded weight)."""
        if (not fuses_attention_block(configured_implementation(self.config), hidden_states)
                or sources is not hidden_states
                or not (self.expert_values and self.expert_output) or hasattr(self.q_proj.weight, "device_mesh")):
            return super().project_inputs(hidden_states, sources)
        batch, length, d = hidden_states.shape
        weights = [self.q_proj.weight, self.k_proj.weight, self.value_selection.weight, self.output_selection.weight]
        query, key, values, output_logits = fused_attention_inputs(
            hidden_states.reshape(-1, d), weights, self.value_experts, self.value_selection, self.num_experts)
        shape = (batch, length, -1, self.head_dim)
        return query.view(shape), key.view(shape), values.view(shape), output_logits

    # Each projection reads the configured implementation and calls the table's function, as Transformers' experts
    # decorator does for the MLP, told that routing is per head (grouped_routing=True).
    def project_values(self, hidden_states, router_states=None):
        # router_states `[B, T, d]`: what the value router reads when it is not hidden_states (MoEUT's peri-LayerNorm)
        batch, length, d = hidden_states.shape
        if not self.expert_values:
            return _linear(self.v_proj, hidden_states).view(batch, length, -1, self.head_dim)
        rows = hidden_states.reshape(-1, 1, d)  # one input row per token
        routed = rows.view(-1, d) if router_states is None else router_states.reshape(-1, d)
        _, gates, index = self.value_selection(autocast_input(routed))
        project = lookup(configured_implementation(self.config))
        values = project(rows, index, self.value_experts, gates, self.num_heads, True)
        return values.view(batch, length, self.num_heads, self.head_dim)

    def project_output(self, attended, hidden_states, routing=None):  # routing: the output router's logits, if made
        batch, length, d = hidden_states.shape
        if not self.expert_output:
            return self.o_proj(attended.reshape(batch, length, -1))
        rows = attended.reshape(-1, self.num_heads, self.head_dim)  # summed over heads and their chosen experts
        destination = hidden_states.reshape(-1, d)
        _, gates, index = self.output_selection(destination if routing is not None else autocast_input(destination),
                                                logits=routing)
        project = lookup(configured_implementation(self.config))
        return project(rows, index, self.output_experts, gates, 1, True).view(batch, length, -1)


class MultiHeadAttention(SwitchHeadAttentionBase):
    """The dense baseline: plain multi-head attention with dense value and output projections.

    With `config.attention_output_gate`, each head's result is scaled by `sigmoid(x_dst W_gate^T)[h]` before the output
    projection: the authors' SwitchHead module with E = 1 (no value-side gate, no top-k).
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        inner = self.num_heads * self.head_dim
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        # W_gate [H, d]: the reference's `sel_o` with one expert per head
        self.output_gate = nn.Parameter(torch.empty(self.num_heads, config.hidden_size)) \
            if config.attention_output_gate else None

    def project_values(self, hidden_states):
        return _linear(self.v_proj, hidden_states).view(*hidden_states.shape[:2], -1, self.head_dim)

    def project_output(self, attended, hidden_states, routing=None):
        if self.output_gate is not None:
            gate = F.linear(autocast_input(hidden_states), self.output_gate)
            attended = attended * torch.sigmoid(gate).unsqueeze(-1)  # [B, T, H, dh]
        return self.o_proj(attended.flatten(2))


ATTENTION_CLASSES = {"switchhead": SwitchHeadAttention, "dense": MultiHeadAttention}


def _linear(projection: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """`projection(inputs)`; a plain `nn.Linear` reads the layer's shared autocast copy of `inputs`
    (`expert_ops.shared_autocast_inputs`), any other module (an adapter, a quantized or sharded layer) `inputs` as
    given."""
    if type(projection) is nn.Linear and type(projection.weight) is nn.Parameter:
        return projection(autocast_input(inputs))
    return projection(inputs)


# ----------------------------------------------------------------------- MoEUT: peri-LayerNorm attention inputs
def peri_attention_inputs(attention: SwitchHeadAttentionBase, normed: torch.Tensor, raw: torch.Tensor) -> tuple:
    """MoEUT's attention inputs: query, key and the value router read the normalised stream `normed` `[B, T, d]`,
    the value projection (expert or dense) the raw residual stream `raw` `[B, T, d]` -> as `project_inputs`."""
    batch, length, d = normed.shape
    shape = (batch, length, -1, attention.head_dim)
    query, key = attention.q_proj(normed).view(shape), attention.k_proj(normed).view(shape)
    if not getattr(attention, "expert_values", False):
        return query, key, attention.v_proj(raw).view(shape), None
    # through `project_values`, which tensor parallelism runs on this process's heads
    return query, key, attention.project_values(raw, router_states=normed).view(shape), None


# ============================================================================================= MLPs
class SwitchHeadMLP(nn.Module):
    """The paper's dense feed-forward block: Linear (bias) -> ReLU -> Linear (bias)."""

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


@use_experts_implementation(has_gate=False, is_transposed=True, has_bias=False)
class SigmaMoeExperts(nn.Module):
    """The sigma-MoE experts as a Transformers experts module: `act(x keys_e) values_e`, gated and summed.

    `config._experts_implementation` picks how they run: "eager" is this forward (the table's "eager" entry), any
    other name the function Transformers registered under it: ours (`experts_integration.py`, the same entries of
    `expert_ops.EXPERTS_IMPLEMENTATIONS` that SwitchHead attention runs) or, with dense attention only, Transformers'
    "batched_mm" / "grouped_mm". The flags: no gated (GLU) projection, no biases, weights `[experts, in, out]`
    (`expert_keys` `[E, d, S]` up, `expert_values` `[E, S, d]` down; checkpoints say `mlp.keys` / `mlp.values`).
    Under expert parallelism a route to another process's expert arrives as the id `num_experts` with gate 0
    (Transformers' sentinel): it adds nothing and receives no gradient.
    """

    is_transposed = True  # expert_keys [E, d, S] and expert_values [E, S, d] are [experts, in, out]

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        d, experts, size = config.hidden_size, config.num_mlp_experts, config.mlp_expert_size
        self.num_experts = experts
        self.expert_keys = nn.Parameter(torch.empty(experts, d, size))  # [E, d, S]
        self.expert_values = nn.Parameter(torch.empty(experts, size, d))  # [E, S, d]
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    @property
    def up_proj(self) -> torch.Tensor:  # the name Transformers' experts functions read
        return self.expert_keys

    @property
    def down_proj(self) -> torch.Tensor:
        return self.expert_values

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden_states `[N, d]`, top_k_index `[N, k]` (experts), top_k_weights `[N, k]` (gates) -> `[N, d]`."""
        index, weights = local_routes(self, top_k_index.long(), top_k_weights)  # expert parallelism's sentinels
        eager = EXPERTS_IMPLEMENTATIONS["eager"]
        inner = self.act_fn(eager(hidden_states.unsqueeze(1), index, self.expert_keys, None, 1))
        return eager(inner, index, self.expert_values, weights, 1).view(hidden_states.shape)


class SigmaMoeMLP(nn.Module):
    """SwitchAll's sigma-MoE: y = sum_{e in topk(s)} s_e * act(x keys_e) values_e, s = sigmoid(x W_sel^T): a router
    `gate` and `experts`, as Transformers' MoE blocks (and their parallel styles) have them; checkpoints say
    `mlp.keys`, `mlp.values`, `mlp.expert_selection.weight` (`checkpoint_format.py`)."""

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        self.config = config  # the experts' config too: PEFT may wrap `experts` (lora.ParamWrapper has no `.config`)
        self.top_k = config.num_mlp_experts_per_tok
        # experts first: their weights are drawn before the router's (`_init_weights` visits children in order)
        self.experts = SigmaMoeExperts(config)
        self.gate = ExpertSelection(config.hidden_size, 1, config.num_mlp_experts, self.top_k,
                                    config.mlp_expert_dropout, True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `[..., d]` -> `[..., d]`."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])  # [N, d]
        _, gates, index = self.gate(tokens)  # [N, k] each
        if self.config._experts_implementation is None and isinstance(self.experts, SigmaMoeExperts):  # built alone:
            # the default a model runs, called directly (Transformers' decorator would log and run eager, and its log
            # breaks torch.compile's graph); wrapped experts (PEFT's) run their wrapper's forward, which adds the LoRA
            implementation = configured_implementation(self.config)
            experts = ALL_EXPERTS_FUNCTIONS.get(implementation, type(self.experts).forward)
            return experts(self.experts, tokens, index, gates).view(shape)
        return self.experts(tokens, index, gates).view(shape)


_ACTIVATIONS = {"relu": relu, "gelu": F.gelu, "silu": F.silu}
MLP_CLASSES = {"dense": SwitchHeadMLP, "sigma_moe": SigmaMoeMLP}


# =========================================================================================== blocks
class SwitchHeadDecoderLayer(GradientCheckpointingLayer):
    """Pre-LayerNorm block: x + drop(attn(LN(x))), then x + drop(mlp(LN(x))).

    With XL memory (the detached inputs of this block on the previous segment, `[B, M, d]`),
    attention also reads LN(memory), normalised by the same LayerNorm, as in the authors' code.
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ATTENTION_CLASSES[config.attention_type](config, layer_idx)
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        memory: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attended, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            memory=self.input_layernorm(memory) if memory is not None else None,
            **kwargs,
        )
        hidden_states = hidden_states + self.dropout(attended)
        return hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))


# ------------------------------------------------------------------------------------- MoEUT: shared layers
class MoEUTDecoderLayer(SwitchHeadDecoderLayer):
    """MoEUT's peri-LayerNorm block (`layernorm_placement="peri"`): with x the raw residual stream,
    a = attn(query, key and routers from LN1(x), values from x); x = x + drop(a); then x + sigma_moe(router from
    LN2(x), experts on x), without dropout on the MLP branch (as the authors' module). The residual stream is
    normalised only by the model's final LayerNorm."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, memory=None,
                **kwargs: Unpack[TransformersKwargs]) -> torch.Tensor:
        attended, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            memory=memory,  # None: the config refuses peri-LayerNorm with XL positions
            value_states=hidden_states,
            **kwargs,
        )
        hidden_states = hidden_states + self.dropout(attended)
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, gates, index = self.mlp.gate(self.post_attention_layernorm(tokens))
        return hidden_states + self.mlp.experts(tokens, index, gates).view(shape)


def decoder_layers(config: SwitchHeadConfig) -> nn.ModuleList:
    """The blocks that have weights: `config.num_distinct_layers` of them (all `num_hidden_layers` without shared
    layers), peri-LayerNorm ones for `layernorm_placement="peri"`."""
    layer_class = MoEUTDecoderLayer if config.layernorm_placement == "peri" else SwitchHeadDecoderLayer
    return nn.ModuleList([layer_class(config, layer_idx) for layer_idx in range(config.num_distinct_layers)])


def applied_layers(layers: nn.ModuleList, config: SwitchHeadConfig) -> list[nn.Module]:
    """The blocks in the order they run, one per application (`num_hidden_layers` in all): without shared layers
    each block once; with them the group of `layer_group_size` blocks, `num_layer_groups` times (application i runs
    block `i % layer_group_size`)."""
    if config.layer_group_size is None:
        return list(layers[: config.num_hidden_layers])
    return [layers[index % config.layer_group_size] for index in range(config.num_hidden_layers)]


class SwitchHeadPreTrainedModel(SavedFolderMixin, ParallelPlansMixin, ExpertsChoiceMixin, PreTrainedModel):
    """`save_pretrained` lists every Auto class in `auto_map` and `load_state_dict` also takes the tensor names of
    earlier releases (`checkpoint_format.py`); parallel plans are checked (`tensor_parallel.py`); the experts
    implementation defaults to ours and refuses MLP-only names (`experts_integration.py`)."""

    config_class = SwitchHeadConfig
    config: SwitchHeadConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SwitchHeadDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the cache's name from Transformers 5.24; before
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False  # XL needs an additive score bias; RoPE SwitchHead would work, but is untested
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # no host syncs, static shapes; output hooks installed at construction
    _can_record_outputs = {
        "router_logits": OutputRecorder(ExpertSelection, index=0),
        "hidden_states": SwitchHeadDecoderLayer,
        "attentions": [OutputRecorder(SwitchHeadAttention, index=1), OutputRecorder(MultiHeadAttention, index=1)],
    }

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The paper's initialisation: std init_scale / sqrt(fan in) for every projection, dense (nn.Linear: q, k,
        W_pk, the dense sides' v and o, the dense MLP) or expert, router rows normalised; std 1 / sqrt(d) for the
        embedding and the output layer. init_scale defaults to sqrt(2 / num_hidden_layers)."""
        scale, d = self.config.init_scale, self.config.hidden_size
        if isinstance(module, SwitchHeadAttention):  # its dense side (if any) is an nn.Linear child
            if module.expert_values:
                init.normal_(module.value_experts, std=scale / math.sqrt(d))
            if module.expert_output:  # fan in: the H * dh inputs of the whole output projection
                init.normal_(module.output_experts, std=scale / math.sqrt(module.num_heads * module.head_dim))
            for router in (getattr(module, "value_selection", None), getattr(module, "output_selection", None)):
                if router is not None:
                    _init_selection(router.weight, std=scale / math.sqrt(d))
        elif isinstance(module, MultiHeadAttention) and module.output_gate is not None:
            _init_selection(module.output_gate, std=scale / math.sqrt(d))  # a router in the reference
        elif isinstance(module, SigmaMoeExperts):  # fan in of the values: the E * S inputs of all experts
            experts, size = module.expert_values.shape[:2]
            init.normal_(module.expert_keys, std=scale / math.sqrt(d))
            init.normal_(module.expert_values, std=scale / math.sqrt(experts * size))
        elif isinstance(module, (nn.Embedding, nn.Linear)):
            ends = isinstance(module, nn.Embedding) or module is getattr(self, "lm_head", None)
            init.normal_(module.weight, std=1.0 / math.sqrt(d) if ends else scale / math.sqrt(module.in_features))
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, SwitchHeadRotaryEmbedding):  # not saved: rebuilt from the config after loading
            module.reset_frequencies()
        elif isinstance(module, ExpertSelection):
            module.group_offsets.copy_(torch.arange(module.num_groups, device=module.group_offsets.device)
                                       * module.num_experts)
            if module.drop_to_zero:  # the sigma-MoE router; attention's are drawn with their layer, after its experts
                _init_selection(module.weight, std=scale / math.sqrt(d))


def _init_selection(weight: torch.Tensor, std: float) -> None:
    """Normal init, each row scaled to unit norm, then the whole tensor rescaled to the std it had."""
    init.normal_(weight, std=std)
    if getattr(weight, "_is_hf_initialized", False):
        return
    drawn_std = weight.std()
    weight.div_(weight.norm(dim=-1, keepdim=True)).mul_(drawn_std / weight.std())


class SwitchHeadModel(SwitchHeadPreTrainedModel):
    """The decoder stack: token embedding, `num_hidden_layers` pre-LN blocks, final LayerNorm."""

    def __init__(self, config: SwitchHeadConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = decoder_layers(config)  # MoEUT: layer_group_size shared blocks
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = rotary_embedding(config)  # None with XL positions
        self.gradient_checkpointing = False
        self.post_init()
        install_output_hooks(self, config)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        xl_memory: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SwitchHeadModelOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The key-value cache (also accepted as `past_key_values`, its name before Transformers 5.24).
        xl_memory (`list[torch.Tensor]`, *optional*):
            Transformer-XL memory: one `[B, M, d]` tensor per layer, the previous segment's `xl_memory`. Every query
            attends to all M memory positions, relative positions continue across the boundary. Only for
            `position_encoding="xl"` and without a KV cache (`use_cache=False`).
        """
        check_inputs(input_ids, inputs_embeds)
        if xl_memory is not None:
            batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            check_xl_memory(self.config, xl_memory, batch, use_cache, cache)
        if self.gradient_checkpointing and self.training:  # recomputed layers would update a cache twice
            cache, use_cache = None, False
        cache, packed = model_cache(cache, use_cache, self.config)
        # memory is for segment-by-segment calls without a KV cache (use_cache=False): decoding keeps its own state
        keep_memory = (self.config.position_encoding == "xl" and self.config.xl_memory_length > 0 and cache is None
                       and not packed)
        if inputs_embeds is None:
            inputs_embeds = embed_tokens(self.embed_tokens, input_ids)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None and not packed else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen)[None]

        memory_length = xl_memory[0].shape[1] if xl_memory is not None else 0
        if memory_length > 0:
            causal_mask = create_xl_memory_mask(self.config, inputs_embeds, attention_mask, memory_length)
        else:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **transformers_cache(cache),
            )
        new_memory = [] if keep_memory else None
        hidden_states = self.embed_dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        for layer_idx, decoder_layer in enumerate(applied_layers(self.layers, self.config)):
            memory = xl_memory[layer_idx].to(hidden_states) if memory_length > 0 else None
            if keep_memory:  # this layer's input, as the authors keep it: before the LayerNorm, detached
                inputs = hidden_states if memory is None else torch.cat((memory, hidden_states), dim=1)
                new_memory.append(inputs[:, -self.config.xl_memory_length :].detach())
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask,
                cache=cache,
                memory=memory,
                use_cache=use_cache,
                position_ids=position_ids,
                cache_layer_idx=layer_idx,  # one cache slot per application (shared layers run several times)
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return SwitchHeadModelOutputWithPast(
            last_hidden_state=hidden_states, xl_memory=new_memory, **transformers_cache(cache)
        )


class SwitchHeadForCausalLM(SwitchHeadPreTrainedModel, GenerationMixin):
    """SwitchHead / SwitchAll language model: the decoder stack plus an (untied, biased) output layer."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # tensor parallelism: vocabulary rows split, logits gathered

    def __init__(self, config: SwitchHeadConfig):
        super().__init__(config)
        self.model = SwitchHeadModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        xl_memory: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SwitchHeadCausalLMOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The key-value cache (also accepted as `past_key_values`, its name before Transformers 5.24).
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids for the language-modelling loss (shifted inside; -100 is ignored). In training, the sigma-MoE
            entropy regulariser times `config.entropy_reg_coef` is added to the loss.
        output_router_logits (`bool`, *optional*):
            Return the logits of every expert router (value, output and sigma-MoE selections) and `aux_loss`.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute logits only for the last `logits_to_keep` positions (or the given indices); 0 keeps all.
        xl_memory (`list[torch.Tensor]`, *optional*):
            Transformer-XL memory from the previous segment's output, with `use_cache=False`:
            `out = model(input_ids=seg, labels=seg, xl_memory=mem, use_cache=False); mem = out.xl_memory`.
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        regularise = self.training and regularised(self.config)
        outputs: SwitchHeadModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            xl_memory=xl_memory,
            output_router_logits=output_router_logits or regularise,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)

        aux_loss = None
        mlp_logits = mlp_router_logits(outputs.router_logits, self.config)
        if self.config.entropy_reg_scope == "group":  # MoEUT: already weighted, over each shared block's uses
            if outputs.router_logits:
                aux_loss = group_entropy_loss(outputs.router_logits, self.config, hidden_states.shape[0],
                                              attention_mask)
                if loss is not None and regularise:
                    loss = loss + aux_loss.to(loss.device)
        elif mlp_logits:
            aux_loss = sigma_moe_entropy_loss(mlp_logits, attention_mask)
            if loss is not None and regularise:
                loss = loss + self.config.entropy_reg_coef * aux_loss.to(loss.device)

        return SwitchHeadCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            **transformers_cache(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits if output_router_logits else None,
            xl_memory=outputs.xl_memory,
        )


# ======================================================================================= task heads
class TaskHead:
    """Transformers' generic heads (as for Llama and Mixtral) build their body with `AutoModel.from_config`: point it at
    the decoder stack for this config's class. This cannot be done once at import: a saved folder's copy of the code is
    handed a config class that Transformers loaded apart from the one the copy imported (a registration at import names
    the wrong class: tests/model/test_task_heads.py, without the package)."""

    def __init__(self, config: SwitchHeadConfig):
        AutoModel.register(type(config), SwitchHeadModel, exist_ok=True)
        super().__init__(config)


class SwitchHeadForSequenceClassification(TaskHead, GenericForSequenceClassification, SwitchHeadPreTrainedModel):
    """A score per label from the last non-padding token's hidden state (`config.pad_token_id` marks padding)."""


class SwitchHeadForTokenClassification(TaskHead, GenericForTokenClassification, SwitchHeadPreTrainedModel):
    """A score per label for every token."""


class SwitchHeadForQuestionAnswering(TaskHead, GenericForQuestionAnswering, SwitchHeadPreTrainedModel):
    """Span start and end logits for every token (extractive question answering)."""


def register() -> None:
    """What this file registers with Transformers, in one place, when it is imported (by the package, or as a saved
    folder's copy, which is imported without the package): the tensor-parallel styles that `base_model_tp_plan` names,
    the checkpoint names of renamed tensors (`checkpoint_format.py`) and our expert projections as Transformers experts
    functions (`experts_integration.py`). The Auto classes are the package's (`switchhead/__init__.py`); the task heads'
    body is `TaskHead`'s."""
    register_styles()
    register_renamed_keys(SwitchHeadConfig.model_type)
    register_experts_functions()


register()

__all__ = ["SwitchHeadPreTrainedModel", "SwitchHeadModel", "SwitchHeadForCausalLM",
           "SwitchHeadForSequenceClassification", "SwitchHeadForTokenClassification",
           "SwitchHeadForQuestionAnswering", "SwitchHeadAttention", "MultiHeadAttention", "SigmaMoeMLP",
           "ExpertSelection", "sigma_moe_entropy_loss",
           "SwitchHeadModelOutputWithPast", "SwitchHeadCausalLMOutputWithPast"]
