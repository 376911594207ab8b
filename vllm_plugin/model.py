"""SwitchHead / SwitchAll / dense baseline models for vLLM's model executor.

The blocks are the package's own modules (`switchhead.modeling_switchhead`): the query / key projections, the
routers (`ExpertSelection`) and expert projections (`expert_projection`) of SwitchHead's values and outputs, the
dense baseline's projections, the dense and sigma-MoE MLPs, under the parameter names our checkpoints use. What
is vLLM's: the paged KV cache and the attention over it (`vllm...attention.Attention`), continuous batching and
prefix caching. Only the attention core changes, so tokens equal `generate()`'s up to floating point.

Per layer and step (T tokens of any number of requests, packed):

    q, k = q_proj(LN(x)), k_proj(LN(x))                      [T, H, dh]
    v = project_values(LN(x))                                # SwitchHead: routed expert values; dense: v_proj
    RoPE: the first num_rotary_channels of q and k rotated (switchhead.positions, every rope_type)
    XL:   q += [scores' position part], k += [cos, sin] channels (see `XLPositionFold`)
    q, k, v zero-padded per head to a head size vLLM's attention accepts (`padded_head_size`), scale dh**-0.5 kept
    o = Attention(q, k, v)[..., :dh]                         # vLLM's paged attention, causal per request
    x = x + project_output(o, LN(x)); x = x + mlp(LN2(x))

Zero channels add nothing to q . k and give zero outputs that are sliced off, so padding is exact.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn

from switchhead import SwitchHeadConfig
from switchhead.expert_ops import default_experts_implementation
from switchhead.modeling_switchhead import ATTENTION_CLASSES, MLP_CLASSES
from switchhead.positions import SwitchHeadRotaryEmbedding, apply_partial_rotary

from .support import check_supported, padded_head_size, xl_folded_head_size

try:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
except ImportError as error:  # pragma: no cover - the module is only imported by vLLM itself
    raise ImportError("switchhead.vllm.model needs vLLM (bash scripts/vllm.sh builds an environment with it)") from error


class XLPositionFold:
    """Transformer-XL's relative-position term as extra query and key channels, exact up to floating point.

    The model adds `scaling * q_i . (W_pk PE(j - i))_h` to the score of query position i and key position j, with
    PE the authors' interleaved sinusoidal encoding (channel 2f: sin(p w_f), 2f + 1: cos(p w_f), w_f =
    10000^(-2f / d); `switchhead.positions.sinusoidal_embedding`). With a = W_pk,h^T q_i (d numbers; a^s the sin
    channels, a^c the cos channels) and p = j - i, each frequency contributes

        a^s sin((j - i) w) + a^c cos((j - i) w)
          = cos(j w) (a^c cos(i w) - a^s sin(i w)) + sin(j w) (a^s cos(i w) + a^c sin(i w)),

    a product of something of query i alone and something of key j alone. So each head's query gets the
    2 * ceil(d / 2) channels in the brackets and its key the channels [cos(j w), sin(j w)] (the same for every
    head), and vLLM's q . k, times the unchanged scale, adds the XL term: no bias input is needed. Angles are taken
    in float64 from the float32 frequencies the model uses, so the split costs no accuracy beyond the model's own
    float32 angle (j - i) w_f.
    """

    def __init__(self, config: SwitchHeadConfig):
        d = config.hidden_size
        self.frequencies = (d + 1) // 2
        self.channels = 2 * self.frequencies
        # as switchhead.positions.sinusoidal_embedding computes them for a float32 model
        self.inv_freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d)).double()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` -> cos, sin of position * w_f, each `[T, frequencies]`, in the compute dtype."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        compute = torch.promote_types(dtype, torch.float32)
        return angles.cos().to(compute), angles.sin().to(compute)

    def query_channels(self, position_query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """position_query a = W_pk^T q `[T, H, d]` -> the extra query channels `[T, H, 2 * frequencies]`."""
        a_sin = position_query[..., 0::2].to(cos.dtype)
        a_cos = position_query[..., 1::2].to(cos.dtype)
        if a_cos.shape[-1] < self.frequencies:  # odd d: the last frequency has its sin channel only
            a_cos = nn.functional.pad(a_cos, (0, self.frequencies - a_cos.shape[-1]))
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((a_cos * cos - a_sin * sin, a_sin * cos + a_cos * sin), dim=-1)

    @staticmethod
    def key_channels(cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """The extra key channels `[T, H, 2 * frequencies]`: [cos(j w), sin(j w)] for every head."""
        return torch.cat((cos, sin), dim=-1)[:, None, :].expand(-1, heads, -1)


class SwitchHeadVllmAttention(nn.Module):
    """One layer's attention: our projections (the package's attention module, passed in) around vLLM's Attention."""

    def __init__(self, config: SwitchHeadConfig, head_size: int, fold: XLPositionFold | None,
                 vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.head_size = head_size
        self.fold = fold
        self.attn = Attention(self.num_heads, head_size, scale=config.head_dim**-0.5,
                              num_kv_heads=self.num_heads, cache_config=vllm_config.cache_config,
                              quant_config=vllm_config.quant_config, prefix=prefix)

    def _pad(self, heads: torch.Tensor) -> torch.Tensor:
        """`[T, H, c]` -> `[T, H * head_size]`, zeros after the c channels."""
        return nn.functional.pad(heads, (0, self.head_size - heads.shape[-1])).flatten(1)

    def forward(self, attention: nn.Module, hidden_states: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None,
                xl: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """attention: the layer's `SwitchHeadAttention` / `MultiHeadAttention`; hidden_states `[T, d]` (normalised)
        -> the attention output `[T, d]`."""
        tokens = hidden_states.shape[0]
        batched = hidden_states[None]  # the package's modules take [B, T, d]
        query = attention.q_proj(hidden_states).view(tokens, self.num_heads, self.head_dim)
        key = attention.k_proj(hidden_states).view(tokens, self.num_heads, self.head_dim)
        value = attention.project_values(batched)[0]  # [T, H, dh], expert-mixed for SwitchHead
        if rotary is not None:  # apply_partial_rotary takes [B, H, T, dh] and cos / sin [B, T, rotary]
            cos, sin = rotary
            query = apply_partial_rotary(query.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
            key = apply_partial_rotary(key.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        if xl is not None:
            cos, sin = xl
            weight = attention.position_key_proj.weight.view(self.num_heads, self.head_dim, -1)  # [H, dh, d]
            position_query = torch.einsum("thc,hcd->thd", query, weight)
            query = torch.cat((query, self.fold.query_channels(position_query, cos, sin).to(query.dtype)), dim=-1)
            key = torch.cat((key, self.fold.key_channels(cos, sin, self.num_heads).to(key.dtype)), dim=-1)
        attended = self.attn(self._pad(query), self._pad(key), self._pad(value))
        attended = attended.view(tokens, self.num_heads, self.head_size)[..., : self.head_dim]
        return attention.project_output(attended[None].contiguous(), batched)[0]


class SwitchHeadVllmDecoderLayer(nn.Module):
    """The pre-LayerNorm block with the package's attention projections and MLP (checkpoint names unchanged)."""

    def __init__(self, config: SwitchHeadConfig, layer_idx: int, head_size: int, fold: XLPositionFold | None,
                 vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = ATTENTION_CLASSES[config.attention_type](config, layer_idx)
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # vLLM's part, without parameters of its own (its KV cache is bound by the prefix)
        self.paged = SwitchHeadVllmAttention(config, head_size, fold, vllm_config, prefix=f"{prefix}.paged.attn")

    def forward(self, hidden_states, rotary, xl):
        attended = self.paged(self.self_attn, self.input_layernorm(hidden_states), rotary, xl)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SwitchHeadVllmModel(nn.Module):
    """Embedding, the blocks, the final LayerNorm: `model.*` of our checkpoints."""

    def __init__(self, config: SwitchHeadConfig, head_size: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.fold = XLPositionFold(config) if config.position_encoding == "xl" else None
        self.layers = nn.ModuleList(
            SwitchHeadVllmDecoderLayer(config, i, head_size, self.fold, vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = SwitchHeadRotaryEmbedding(config) if config.position_encoding == "rope" else None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = xl = None
        if self.rotary_emb is not None:  # the model's own cos / sin for these positions (every rope_type)
            rotary = self.rotary_emb(hidden_states, positions[None])
        if self.fold is not None:
            xl = self.fold.tables(positions, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, rotary, xl)
        return self.norm(hidden_states)


class SwitchHeadForCausalLM(nn.Module):
    """vLLM's model for `architectures: ["SwitchHeadForCausalLM"]` (registered by the `switchhead` plugin)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config)
        config = copy.deepcopy(config)
        # the experts implementation generate() runs by default (SwitchHeadPreTrainedModel)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        config._experts_implementation = default_experts_implementation(ALL_EXPERTS_FUNCTIONS)
        self.config = config
        needed = xl_folded_head_size(config) if config.position_encoding == "xl" else config.head_dim
        self.head_size = padded_head_size(needed)
        self.model = SwitchHeadVllmModel(config, self.head_size, vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Our safetensors as saved: every tensor must name a parameter of this model with the same shape."""
        parameters = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _current_name(name, parameters)
            if name not in parameters:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue  # tied: the embedding is the output layer
                raise ValueError(f"switchhead.vllm: the checkpoint holds {name!r} {tuple(tensor.shape)}, which "
                                 f"this {_describe(self.config)} model has no parameter for; the checkpoint does "
                                 f"not match its config.json")
            parameter = parameters[name]
            if parameter.shape != tensor.shape:
                raise ValueError(f"switchhead.vllm: {name!r} is {tuple(tensor.shape)} in the checkpoint, but "
                                 f"config.json gives {tuple(parameter.shape)}")
            with torch.no_grad():
                parameter.copy_(tensor)
            loaded.add(name)
        return loaded


def _renamed_keys() -> dict[str, str]:
    """Tensor names older releases of the package saved under -> today's (`switchhead.checkpoint_format`, where this
    release of the package has renamings)."""
    try:
        from switchhead.checkpoint_format import RENAMED_KEYS
    except ImportError:
        return {}
    return dict(RENAMED_KEYS)


def _current_name(name: str, parameters: dict) -> str:
    """A checkpoint tensor's name as this model's parameter: itself, or the renamed one of an older checkpoint."""
    if name in parameters:
        return name
    for old, new in _renamed_keys().items():
        if name.endswith("." + old) and name[: -len(old)] + new in parameters:
            return name[: -len(old)] + new
    return name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(config) -> str:
    return f"{config.attention_type}/{config.position_encoding}/{config.mlp_type}"


__all__ = ["SwitchHeadForCausalLM", "XLPositionFold"]
