"""Positions for SwitchHead's attention: rotary embeddings (with Transformers' RoPE scaling types), Transformer-XL
relative positions, XL memory masking and the paged-cache layout.

RoPE rotates the first `num_rotary_channels` channels of each head (NeoX layout). The XL term of query i and key j
is `scaling * q_i . (W_pk PE(j - i))_h`, PE the sinusoidal encoding of the signed distance in the authors'
interleaved layout, W_pk the attention's `position_key_proj`. Keys are indexed XL memory or cache first, then the
current tokens, so a distance is the same in one pass, in chunks through a cache and across the memory boundary.
Under continuous batching (a paged cache) the requests are packed into one row, and `paged_key_distances` gives each
query its distances to its own request's keys.

Part of the Hub-ready model: this file imports only torch, transformers and its siblings.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_switchhead import SwitchHeadConfig
from .transformers_compat import incompatible_release

try:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError as error:  # a release too old (or too new) for this file: say which to install
    raise incompatible_release(error) from error


# ---------------------------------------------------------------------------------------------------- rotary
class _RotatedChannels:
    """The config fields Transformers' `ROPE_INIT_FUNCTIONS` read, describing only the rotated channels.

    Those functions derive the rotary width as `int(head_dim * partial_rotary_factor)`; ours rounds down to an even
    count (`num_rotary_channels`), so they get head_dim = num_rotary_channels and a factor of 1.
    """

    def __init__(self, config: SwitchHeadConfig):
        self.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}
        self.rope_parameters.setdefault("rope_theta", config.default_theta)
        self.rope_parameters.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        self.head_dim = config.num_rotary_channels
        self.hidden_size, self.num_attention_heads = config.hidden_size, config.num_attention_heads
        self.max_position_embeddings = config.max_position_embeddings

    def standardize_rope_params(self) -> None:  # already standard (see __init__)
        pass


class SwitchHeadRotaryEmbedding(nn.Module):
    """NeoX-style RoPE on the first `num_rotary_channels` channels of each head (the paper rotates half).

    `config.rope_parameters["rope_type"]` picks the frequencies of the rotated channels: "default" (the paper's)
    and "dynamic" (NTK-aware, from the forward's longest position) are computed in every forward in at least fp32
    with tensor ops only; "linear", "yarn", "llama3" and "longrope" come from Transformers' `ROPE_INIT_FUNCTIONS`,
    with their attention factor applied to cos and sin (longrope switches to its long factors past
    `original_max_position_embeddings`). `inv_freq` / `long_inv_freq` are float32 buffers, not saved, rebuilt from
    the config after loading and after every `.to()` (so a cast never rounds them).
    """

    def __init__(self, config: SwitchHeadConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        params = config.rope_parameters
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type != "default" and self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters['rope_type']={self.rope_type!r} is not a RoPE type of this "
                             f"Transformers version; use 'default' or one of {sorted(ROPE_INIT_FUNCTIONS)}")
        self.rotary = config.num_rotary_channels
        self.base = float(params.get("rope_theta", config.default_theta))
        self.factor = float(params.get("factor") or 1.0)
        # the context the frequencies were made for: dynamic scales past max_position_embeddings (as Transformers
        # does), longrope switches past original_max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "longrope":
            self.original_max_seq_len = int(params.get("original_max_position_embeddings",
                                                       config.max_position_embeddings))
        self.attention_scaling = 1.0
        self.reset_frequencies(device)

    def _default_frequencies(self, device, dtype) -> torch.Tensor:
        return self.base ** (-torch.arange(0, self.rotary, 2, device=device, dtype=dtype) / self.rotary)

    @torch.no_grad()
    def reset_frequencies(self, device: torch.device | str | None = None) -> None:
        """(Re)build the float32 frequency buffers from the config on `device` (default: where they are now, or the
        default device when there are none yet, e.g. meta while `from_pretrained` builds the model)."""
        if device is None:
            device = self.inv_freq.device if "inv_freq" in self._buffers else torch.get_default_device()
        if self.rope_type in ("default", "dynamic"):
            inv_freq = self._default_frequencies(device, torch.float32)
        else:
            fraction = _RotatedChannels(self.config)
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](fraction, device)
            if self.rope_type == "longrope":
                long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](fraction, device,
                                                                   seq_len=self.original_max_seq_len + 1)
                self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset_frequencies()  # rebuilt in float32 wherever they went (a cast would round them)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[B, T]` -> (cos, sin), each `[B, T, num_rotary_channels]` in x's dtype."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        if self.rope_type == "default":
            inv_freq = self._default_frequencies(x.device, dtype)
        elif self.rope_type == "dynamic":
            # NTK-aware base for this forward's length L = max(longest position + 1, original), as a tensor
            length = (position_ids.max() + 1).to(dtype).clamp(min=self.original_max_seq_len)
            growth = self.factor * length / self.original_max_seq_len - (self.factor - 1)
            base = self.base * growth ** (self.rotary / (self.rotary - 2))
            inv_freq = base ** (-torch.arange(0, self.rotary, 2, device=x.device, dtype=dtype) / self.rotary)
        else:
            inv_freq = self.inv_freq.to(device=x.device, dtype=dtype)
            if self.rope_type == "longrope":
                beyond = position_ids.max() + 1 > self.original_max_seq_len
                inv_freq = torch.where(beyond, self.long_inv_freq.to(device=x.device, dtype=dtype), inv_freq)
        freqs = position_ids[..., None].to(dtype) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, dh]`; rotates its first `cos.shape[-1]` channels, passes the rest through."""
    rotary = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


# ---------------------------------------------------------------------------------------------------- Transformer-XL
def sinusoidal_embedding(positions: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinusoidal encoding of (relative) positions `[P]` -> `[P, dim]`, the authors' layout (interleaved).

    Channel 2f holds sin(p * w_f) and channel 2f + 1 holds cos(p * w_f), w_f = 10000^(-2f / dim): the layout of
    `sinusoidal_pos_embedding` in the authors' code, which their `pos_to_pk` weights were trained against.
    `dtype` is the computation dtype (at least float32; float64 for float64 models).
    """
    dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=dtype) * (-math.log(10000.0) / dim))
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]  # [P, ceil(dim / 2)]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[:, :dim]


_PAST_ENCODINGS: dict[tuple, torch.Tensor] = {}  # (dim, computation dtype, device) -> rows for p = 0, -1, -2, ...


def past_sinusoidal_encoding(num_distances: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`sinusoidal_embedding` of the relative positions 0, -1, ..., -(num_distances - 1): `[num_distances, dim]`.

    Input-independent, so calls read it from one table per (dim, dtype, device), grown by doubling and sliced
    (row p is the same value however long the table is): a decoding step does not recompute the encoding of every
    distance in every layer. Eager calls build and grow the table. Under torch.compile an existing table that is
    long enough is read (dynamo lifts it as a graph input and guards on it: a table grown later recompiles once);
    otherwise the encoding is computed in the graph (no Python-side state is written while tracing).
    """
    dtype = torch.promote_types(dtype, torch.float32)
    key = (dim, dtype, device)
    table = _PAST_ENCODINGS.get(key)
    if torch.compiler.is_compiling() or device.type == "meta":  # read a table, never write one
        if table is not None and table.shape[0] >= num_distances:
            return table[:num_distances]
        return sinusoidal_embedding(-torch.arange(num_distances, device=device), dim, dtype)
    if table is None or table.shape[0] < num_distances:
        rows = max(num_distances, 256, 2 * table.shape[0] if table is not None else 0)
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable later with autograd on
            table = sinusoidal_embedding(-torch.arange(rows, device=device), dim, dtype)
        _PAST_ENCODINGS[key] = table
    return table[:num_distances]


# Attention implementations that add `position_bias` to the scores: the model's eager function, Transformers' sdpa
# (as a float mask) and flex_attention (in its score_mod).
XL_BIAS_ATTENTION = ("eager", "sdpa", "flex_attention")


def check_xl_attention(implementation: str | None, attention_function) -> None:
    """Refuse an attention function that would drop the XL position term and give wrong outputs silently.

    vLLM's Transformers backend, for one, registers a function that takes q, k and v and ignores other keyword
    arguments. A function registered under another name can declare that it adds `position_bias` to its scores
    with `attention_function.adds_position_bias = True`.
    """
    if implementation in (None, *XL_BIAS_ATTENTION) or getattr(attention_function, "adds_position_bias", False):
        return
    raise ValueError(
        f"position_encoding='xl' needs an attention implementation that adds the relative-position bias "
        f"(`position_bias`) to the scores; {implementation!r} does not, so its outputs would ignore the positions. "
        f"Use attn_implementation 'eager', 'sdpa' or 'flex_attention' (with vLLM, the switchhead plugin, not "
        f"model_impl='transformers'), or mark a function that adds it with `adds_position_bias = True`."
    )


def xl_position_bias(attention: nn.Module, query: torch.Tensor, key_length: int,
                     query_offset: int = 0) -> torch.Tensor:
    """The Transformer-XL position term for query i and key j, as an additive score bias `[B, H, Tq, Tk]`.

    bias[b, h, i, j] = scaling * q_i . (W_pk PE(j - i))_h, where i and j are indices into the key sequence
    (XL memory or cache first, then the current tokens; query t of this call sits at index query_offset + t).
    PE is `sinusoidal_embedding` of the signed relative position j - i (<= 0 for the visible past), W_pk is
    `position_key_proj` applied to PE and then split into heads, and `scaling = head_dim**-0.5` multiplies the
    term exactly as it multiplies q . k. This is the authors' convention (their code scales q and PE by
    head_dim**-0.25 each and takes `shift(q @ (PE W_pk^T)^T)`), without the u/v biases. Future keys (j > i)
    get the value of distance 0; the causal mask removes them.

    The path is chosen from Python integers only: the relative shift where the query offset and key length are
    plain ints and the last query sees the last key; otherwise (a tensor offset: a static cache, compiled
    decoding) the gather, so no tensor is ever read as a bool (no host sync, no data-dependent graph break).
    """
    query_length = query.shape[2]
    num_distances = key_length  # the largest distance seen is (last query) - (first key) <= key_length - 1
    static = type(query_offset) is int and type(key_length) is int and type(query_length) is int
    if static and query_offset + query_length == key_length:  # the last query sees the last key: the shift
        return relative_shift(xl_distance_scores(attention, query, num_distances, oldest_first=True))
    return xl_position_bias_gathered(attention, query, key_length, query_offset)


def relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """`[..., Tq, K]` scores against the relative positions -(K - 1), ..., -1, 0 (oldest first) -> the bias
    `[..., Tq, K]` over keys, for queries at key indices K - Tq .. K - 1: bias[i, j] = scores[i, j + Tq - 1 - i]
    wherever key j is not in query i's future (j <= K - Tq + i). A future key reads another entry (any value: the
    causal mask removes it).

    The authors' shift, as views: one zero column in front makes rows of K + 1, and the same memory read from the
    Tq-th element on, in rows of K, starts each row one entry further left than the row before. One copy of the
    scores (the pad), no index tensor, and a backward of views and that pad's slice (a gather over distances keeps a
    `[Tq, K]` index and runs a scatter-add of the bias's size)."""
    *lead, query_length, width = scores.shape
    padded = F.pad(scores, (1, 0))  # [..., Tq, K + 1]
    flat = padded.view(*lead, query_length * (width + 1))
    return flat[..., query_length:].view(*lead, query_length, width)


def xl_position_bias_gathered(attention: nn.Module, query: torch.Tensor, key_length: int,
                              query_offset: int = 0) -> torch.Tensor:
    """`xl_position_bias` for any key layout (a static cache's keys past the queries too), by a gather over the
    distances: the reference twin of `relative_shift`."""
    query_length = query.shape[2]
    num_distances = key_length
    by_distance = xl_distance_scores(attention, query, num_distances)  # [B, H, Tq, distance]
    query_index = torch.arange(query_length, device=query.device) + query_offset
    key_index = torch.arange(key_length, device=query.device)
    distance = (query_index[:, None] - key_index[None, :]).clamp(0, num_distances - 1)  # [Tq, Tk]
    return by_distance.gather(-1, distance.expand(*by_distance.shape[:2], -1, -1))


def xl_distance_scores(attention: nn.Module, query: torch.Tensor, num_distances: int,
                       oldest_first: bool = False) -> torch.Tensor:
    """scaling * q . (W_pk PE(-r))_h for the distances r = 0 .. num_distances - 1: `[B, H, Tq, num_distances]`
    (`oldest_first`: the distances in the other order, num_distances - 1 first, as `relative_shift` reads them).

    Two orders of the same product: project every distance's encoding into key space (`W_pk PE`, right for
    many queries: training, prefill), or project the queries back into model space (`W_pk^T q`, then one
    matmul with the encodings: right for a few queries, i.e. decoding, where it skips the `num_distances x d x
    H*dh` projection of every step and layer). The encodings come from `past_sinusoidal_encoding`.
    """
    batch, heads, query_length, head_dim = query.shape
    encoding = past_sinusoidal_encoding(num_distances, attention.config.hidden_size, query.dtype, query.device)
    encoding = encoding.to(query.dtype)  # [K, d]
    if oldest_first:
        encoding = encoding.flip(0)  # [K, d]: a copy of the encodings, not of the scores
    weight = _plain_weight(attention.position_key_proj)
    if weight is not None and batch * query_length * (head_dim + num_distances) < num_distances * head_dim:
        weight = weight.view(heads, head_dim, -1)  # W_pk split into heads [H, dh, d]
        back = torch.einsum("bhqc,hcd->bhqd", query, weight)  # [B, H, Tq, d]
        return torch.matmul(back, encoding.t()) * attention.scaling
    position_keys = attention.position_key_proj(encoding).view(num_distances, heads, head_dim)
    return torch.einsum("bhqd,khd->bhqk", query, position_keys) * attention.scaling


def _plain_weight(projection: nn.Module) -> torch.Tensor | None:
    """The `[out, in]` matrix of a projection that is exactly `x @ W^T`: an `nn.Linear` holding a plain parameter.
    None for anything else (an adapter wrapping it, a quantized or sharded weight): those are applied as modules."""
    if type(projection) is nn.Linear and type(projection.weight) is nn.Parameter and projection.bias is None:
        return projection.weight
    return None


def paged_key_distances(kwargs: dict, query_length: int, key_length: int, device,
                        paged: bool | None = None) -> torch.Tensor | None:
    """Continuous batching (paged cache): relative distance query - key for the packed batch, `[Tq, Tk]`, or None.

    Transformers' continuous batching calls the model with every scheduled request packed into one row: queries
    `[cu_seq_lens_q[r], cu_seq_lens_q[r+1])` belong to request r, and the attention function reads request r's keys
    back from the paged cache as `[cu_seq_lens_k[r], cu_seq_lens_k[r+1])`, in position order (cached ones first, then
    this step's). So key j of request r sits at position j - cu_seq_lens_k[r], and query i at position
    (i - cu_seq_lens_q[r]) + (keys of r) - (queries of r). Entries between different requests get a distance too;
    the block-diagonal mask removes them. Padding rows or columns past the last request count as the last request.
    None when the call is not a paged one: `paged` false (by default: no `cache` in the kwargs, where Transformers
    before 5.24 passes the paged cache), or no `cu_seq_lens_k` in the kwargs.
    """
    if paged is None:
        paged = kwargs.get("cache") is not None
    if not paged or kwargs.get("cu_seq_lens_k") is None or kwargs.get("cu_seq_lens_q") is None:
        return None
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):  # one entry per attention type; SwitchHead layers are all full attention
        cu_k = cu_k.get("full_attention", next(iter(cu_k.values())))
    cu_q = kwargs["cu_seq_lens_q"].to(device=device, dtype=torch.long)
    cu_k = cu_k.to(device=device, dtype=torch.long)
    last = cu_q.numel() - 2
    query_index, key_index = torch.arange(query_length, device=device), torch.arange(key_length, device=device)
    query_request = (torch.searchsorted(cu_q, query_index, right=True) - 1).clamp(0, last)
    key_request = (torch.searchsorted(cu_k, key_index, right=True) - 1).clamp(0, last)
    keys_of, queries_of = cu_k[1:] - cu_k[:-1], cu_q[1:] - cu_q[:-1]
    query_position = query_index - cu_q[query_request] + keys_of[query_request] - queries_of[query_request]
    key_position = key_index - cu_k[key_request]
    return query_position[:, None] - key_position[None, :]


def xl_paged_attention_mask(attention: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
                            distance: torch.Tensor) -> torch.Tensor:
    """Continuous batching with XL positions: the paged call's mask `[1, 1, Tq, Tk]` plus the XL bias.

    `distance` `[Tq, Tk]` comes from `paged_key_distances` (each request's own key positions in the paged
    cache). The bias is the one `xl_position_bias` defines, gathered at those distances, and it is folded into
    the additive mask so that every paged attention function (sdpa, eager) applies it. No host sync: the
    distances are bounded statically by the mask's key length Tk (a query of request r sits at most at
    position keys_of[r] - 1 <= Tk - 1, a key at position >= 0), so `xl_distance_scores` is asked for Tk
    distances whatever the packed requests are; entries beyond a request's own keys are masked anyway.
    """
    if attention_mask is None:
        raise ValueError(
            "position_encoding='xl' under continuous batching needs the materialised paged attention mask "
            "(attn_implementation 'sdpa' or 'eager'); flash/block-table paged attention cannot add the XL "
            "relative-position bias")
    num_distances = attention_mask.shape[-1]  # static bound (see above)
    by_distance = xl_distance_scores(attention, query, num_distances)  # [1, H, Tq, distance]
    index = distance.clamp(0, num_distances - 1).expand(*by_distance.shape[:2], -1, -1)
    bias = by_distance.gather(-1, index)  # [1, H, Tq, Tk]
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, bias, torch.finfo(bias.dtype).min)
    return bias + attention_mask.to(bias.dtype)


def xl_attention_inputs(attention: nn.Module, query: torch.Tensor, key_length: int,
                        attention_mask: torch.Tensor | None, query_offset: int, packed: bool, kwargs: dict,
                        attention_function) -> tuple[torch.Tensor | None, dict]:
    """What XL positions add to an attention call: (the mask, extra keyword arguments for the attention function).

    A continuous-batching call (packed requests, keys from the paged cache) folds the bias into its mask
    (`xl_paged_attention_mask`); any other call passes it as `position_bias` (`xl_position_bias`), to an attention
    function that adds it (`check_xl_attention`). Attention without XL positions: the mask unchanged, no extras.
    """
    if attention.position_encoding != "xl":
        return attention_mask, {}
    if attention_mask is not None:
        distance = paged_key_distances(kwargs, query.shape[2], attention_mask.shape[-1], query.device, paged=packed)
        if distance is not None:
            return xl_paged_attention_mask(attention, query, attention_mask, distance), {}
    check_xl_attention(attention.config._attn_implementation, attention_function)
    return attention_mask, {"position_bias": xl_position_bias(attention, query, key_length, query_offset)}


def rotary_embedding(config) -> SwitchHeadRotaryEmbedding | None:
    """The model's RoPE module (None with XL positions, which refuse RoPE scaling: there is no RoPE to scale).
    Checked here as well as in the config, which can be edited after it was validated."""
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if config.position_encoding != "rope" and rope_type != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} needs position_encoding='rope'; this model uses "
            f"{config.position_encoding!r} positions (no RoPE to scale): drop the RoPE scaling"
        )
    return SwitchHeadRotaryEmbedding(config) if config.position_encoding == "rope" else None


def create_xl_memory_mask(
    config,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    memory_length: int,
):
    """The paper's masking with XL memory, in the format of the configured attention backend.

    Query t (of T) sees all `memory_length` memory positions and the current positions <= t: the causal mask of
    queries placed at key indices M..M+T-1, like a cache prefix. `attention_mask` is a 2D padding mask over the
    current tokens `[B, T]` (memory all valid) or over memory and current tokens `[B, M + T]`; a 4D mask is
    returned unchanged. The mask is always materialised, so that no backend falls back to its own causal mask
    (sdpa's `is_causal` aligns to the top-left and would hide the memory from the first queries).
    """
    batch, length = inputs_embeds.shape[:2]
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] not in (length, memory_length + length):
            raise ValueError(
                f"with xl_memory, attention_mask must be 2D [batch, {length}] (current tokens) or "
                f"[batch, {memory_length + length}] (memory then current tokens), got {tuple(attention_mask.shape)}"
            )
        attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
        if attention_mask.shape[-1] == length:
            attention_mask = F.pad(attention_mask, (memory_length, 0), value=True)
    if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"xl_memory needs attn_implementation 'eager', 'sdpa' or 'flex_attention', "
            f"got {config._attn_implementation!r}"
        )
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=batch,
        q_length=length,
        kv_length=memory_length + length,
        q_offset=memory_length,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        dtype=inputs_embeds.dtype,
        config=config,
        device=inputs_embeds.device,
    )


def check_xl_memory(config, xl_memory, batch: int, use_cache, cache) -> None:
    """Reject XL memory that does not fit this model or call, saying what to change."""
    if config.position_encoding != "xl":
        raise ValueError(f"xl_memory needs position_encoding='xl', this model uses {config.position_encoding!r}")
    if use_cache or cache is not None:
        raise ValueError(
            "xl_memory cannot be combined with a KV cache: pass use_cache=False (and no cache); "
            "generation continues a sequence through the KV cache instead"
        )
    if not isinstance(xl_memory, (list, tuple)) or len(xl_memory) != config.num_hidden_layers:
        raise ValueError(
            f"xl_memory must be a list of {config.num_hidden_layers} tensors (one per layer), got "
            f"{type(xl_memory).__name__} of length {len(xl_memory) if hasattr(xl_memory, '__len__') else '?'}"
        )
    shape = tuple(xl_memory[0].shape)
    if len(shape) != 3 or shape[0] != batch:
        raise ValueError(f"xl_memory tensors must be [batch={batch}, memory_length, d], got {shape}")
    for layer_idx, memory in enumerate(xl_memory):
        if memory.dim() != 3 or memory.shape[-1] != config.hidden_size or tuple(memory.shape) != shape:
            raise ValueError(
                f"xl_memory[{layer_idx}] must have shape [batch, memory_length, {config.hidden_size}] like "
                f"xl_memory[0] {shape}, got {tuple(memory.shape)}"
            )
