"""`SwitchHeadRope` and `SwitchHeadXL`: the authors' attention modules' interface on `SwitchHeadAttention`.

Each holds one of our attention layers (`self.attention`, built from a `SwitchHeadConfig` that the constructor
arguments describe) and, for RoPE, our rotary embedding: the projections, the routing, the expert projection
(`experts_implementation=`), the positions and the cache are those of the Transformers model, one code path.
What this file adds is the authors' calling convention: `forward(q_src, k_src, v_src, mask, kv_cache)` ->
`(output, kv_cache)`, their `AttentionMask` (True where a key is hidden), their initialisation and their tensor
names (`q.weight, k.weight, v, o, sel_v, sel_o`, XL's `pos_to_pk`; with `n_experts=1`: `v`, `o` dense and a per-head
output gate `sel_o`, our dense attention with `attention_output_gate=True`).

Their `dropout` drops query channels before the positions are applied (not attention probabilities): a forward hook
on the query projection does that here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from switchhead.configuration_switchhead import SwitchHeadConfig
from switchhead.expert_ops import lookup
from switchhead.modeling_switchhead import ATTENTION_CLASSES
from switchhead.positions import rotary_embedding

from .names import use_authors_names

# the authors' cache: None (no cache), or a dict that holds this layer's keys "k" and values "v" `[B, H, T, dh]`
KVCache = dict[str, torch.Tensor] | None


@dataclass
class AttentionMask:
    """The authors' mask: True where attention is forbidden.

    position_mask: `[Tq, Tk']` or `[B, Tq, Tk']` (Tk' <= the number of keys: cached keys left of it stay visible).
    src_length_mask: `[B, Tk]`, True at padded keys.
    """

    position_mask: torch.Tensor | None = None
    src_length_mask: torch.Tensor | None = None


class _DictCache:
    """The authors' dict cache as the cache our attention layer updates (`get_seq_length`, `update`): keys and
    values of every step so far. Keys are stored after RoPE, at their own positions, which makes it exact."""

    def __init__(self, past: dict[str, torch.Tensor]):
        self.state = dict(past)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.state["k"].shape[-2] if "k" in self.state else 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0):
        if "k" in self.state:
            key = torch.cat((self.state["k"], key), dim=-2)
            value = torch.cat((self.state["v"], value), dim=-2)
        self.state = {"v": value, "k": key}
        return key, value


def _same_tokens(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b is a (the same view of the same memory as a: `x[:, :4]` twice counts)."""
    if a is b:
        return True
    if torch.compiler.is_compiling():  # no storage pointers in a graph: the same tensor object only
        return False
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.data_ptr() == b.data_ptr())


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _renorm_rows(weight: torch.Tensor) -> None:
    """The authors' router rescaling: each row divided by its norm and multiplied by the std it was drawn with,
    over the std of the whole tensor of unit rows."""
    row_std = weight.std(dim=-1, keepdim=True)
    weight.div_(weight.norm(dim=-1, keepdim=True))
    weight.mul_(row_std / weight.std())


class _SwitchHeadDropIn(nn.Module):
    """What `SwitchHeadRope` and `SwitchHeadXL` share."""

    position_encoding: str

    def __init__(self, d_model: int, n_heads: int, n_experts: int, dropout: float = 0.0, d_head: int | None = None,
                 expert_dropout: float = 0.0, moe_k: int = 2, init_scale: float = 1.0,
                 experts_implementation: str | None = None, attn_implementation: str = "sdpa", **positions):
        super().__init__()
        _check_positive(d_model=d_model, n_heads=n_heads, n_experts=n_experts, moe_k=moe_k)
        if d_head is not None:
            _check_positive(d_head=d_head)
        if n_experts > 1 and moe_k > n_experts:
            raise ValueError(f"moe_k={moe_k} exceeds n_experts={n_experts}: each head picks moe_k of its n_experts")
        for name, value in (("dropout", dropout), ("expert_dropout", expert_dropout)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if experts_implementation is not None:
            lookup(experts_implementation)  # a name outside the table: the ValueError that lists it
        if experts_implementation == "switchhead_fused" and dropout > 0:  # its GEMM makes q without q_proj's hook
            raise ValueError(f"dropout={dropout} with experts_implementation='switchhead_fused': the fused block makes "
                             "the queries inside one GEMM, where the query dropout cannot act; use another "
                             "experts_implementation or dropout=0")
        self.n_heads, self.n_experts, self.moe_k = n_heads, n_experts, moe_k
        self.input_size = self.output_size = d_model
        self.projection_size = d_head or d_model // n_heads
        if self.projection_size < 1:
            raise ValueError(f"d_head: d_model // n_heads = {d_model} // {n_heads} is 0; give d_head")
        self.expert_dropout = expert_dropout
        dense = n_experts == 1  # the authors' one-expert module: a dense attention with a per-head output gate
        self.config = SwitchHeadConfig(
            vocab_size=1, hidden_size=d_model, num_hidden_layers=1, num_attention_heads=n_heads,
            head_dim=self.projection_size, attention_type="dense" if dense else "switchhead",
            attention_output_gate=dense, num_attention_experts=max(n_experts, 2) if dense else n_experts,
            num_attention_experts_per_tok=1 if dense else moe_k, attention_expert_dropout=expert_dropout,
            attention_dropout=0.0, init_scale=init_scale, position_encoding=self.position_encoding, **positions)
        self.config._experts_implementation = experts_implementation  # None: the default a model gets
        self.config._attn_implementation = attn_implementation
        # the random numbers drawn while building, as the authors' constructor draws them (nn.Linear's own init of q
        # and k, nothing else: their other tensors start empty), so that one seed gives both modules one init
        rng = torch.random.get_rng_state()
        self.attention = ATTENTION_CLASSES[self.config.attention_type](self.config, 0)
        torch.random.set_rng_state(rng)
        self.attention.q_proj.reset_parameters()
        self.attention.k_proj.reset_parameters()
        self.rotary = rotary_embedding(self.config)  # None for XL
        self.query_dropout = nn.Dropout(dropout)
        self.attention.q_proj.register_forward_hook(self._drop_query)
        names = {"q_proj.weight": "q.weight", "k_proj.weight": "k.weight"}
        if dense:
            names.update({"v_proj.weight": "v", "o_proj.weight": "o", "output_gate": "sel_o"})
        else:
            names.update({"value_experts": "v", "output_experts": "o", "value_selection.weight": "sel_v",
                          "output_selection.weight": "sel_o"})
        names["position_key_proj.weight"] = "pos_to_pk"
        use_authors_names(self, {f"attention.{ours}": theirs for ours, theirs in names.items()})
        self.reset_parameters(init_scale)

    def _drop_query(self, _module: nn.Module, _inputs, query: torch.Tensor) -> torch.Tensor:
        return self.query_dropout(query)  # the authors' dropout: on the queries, before their positions

    # the authors' attribute names, as views of our layer's tensors
    @property
    def q(self) -> nn.Linear:
        return self.attention.q_proj

    @property
    def k(self) -> nn.Linear:
        return self.attention.k_proj

    @property
    def v(self) -> torch.Tensor:
        return self.attention.v_proj.weight if self.n_experts == 1 else self.attention.value_experts

    @property
    def o(self) -> torch.Tensor:
        return self.attention.o_proj.weight if self.n_experts == 1 else self.attention.output_experts

    @property
    def sel_v(self) -> torch.Tensor:
        if self.n_experts == 1:
            raise AttributeError("sel_v: a module with n_experts=1 has no value-side router")
        return self.attention.value_selection.weight

    @property
    def sel_o(self) -> torch.Tensor:
        return self.attention.output_gate if self.n_experts == 1 else self.attention.output_selection.weight

    @torch.no_grad()
    def reset_parameters(self, init_scale: float) -> None:
        """The authors' initialisation, drawn in their order: routers (`sel_v`, then `sel_o`; rows renormalised),
        `k`, `q`, `v` (std init_scale / sqrt(d_model)), then `o` (std init_scale / sqrt(n_heads * d_head))."""
        d = self.input_size
        if self.n_experts > 1:
            nn.init.normal_(self.sel_v, 0.0, init_scale / math.sqrt(d))
            _renorm_rows(self.sel_v)
        nn.init.normal_(self.sel_o, 0.0, init_scale / math.sqrt(d))
        _renorm_rows(self.sel_o)
        for weight in (self.k.weight, self.q.weight, self.v):
            nn.init.normal_(weight, 0.0, init_scale / math.sqrt(d))
        nn.init.normal_(self.o, 0.0, init_scale / math.sqrt(self.n_heads * self.projection_size))

    def _keep_mask(self, mask: AttentionMask | None, batch: int, length: int, keys: int,
                   device: torch.device) -> torch.Tensor:
        """The authors' mask (True: hidden) -> ours (True: kept), `[B or 1, 1, Tq, Tk]`; None: causal, the cached
        keys all visible."""
        position = mask.position_mask if mask is not None else None
        source = mask.src_length_mask if mask is not None else None
        if position is None:
            position = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        if position.dim() not in (2, 3) or position.shape[-2] != length or position.shape[-1] > keys \
                or (position.dim() == 3 and position.shape[0] not in (1, batch)):
            raise ValueError(f"mask.position_mask has shape {tuple(position.shape)}; expected [Tq, Tk'] or "
                             f"[B, Tq, Tk'] with Tq = {length} queries, Tk' <= {keys} keys and B = {batch}")
        if position.dtype != torch.bool:
            raise ValueError(f"mask.position_mask must be a bool tensor (True: hidden), got {position.dtype}")
        hidden = nn.functional.pad(position, (keys - position.shape[-1], 0), value=False)
        hidden = hidden.view(-1, 1, length, keys)
        if source is not None:
            if source.dim() != 2 or tuple(source.shape) != (batch, keys) or source.dtype != torch.bool:
                raise ValueError(f"mask.src_length_mask has shape {tuple(source.shape)} ({source.dtype}); expected a "
                                 f"bool [B, Tk] = [{batch}, {keys}] (True at padded keys)")
            hidden = hidden | source[:, None, None, :]
        return ~hidden

    def forward(self, q_src: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor,
                mask: AttentionMask | None = None, kv_cache: KVCache = None) -> tuple[torch.Tensor, KVCache]:
        """q_src = k_src = v_src `[B, T, d_model]` -> (`[B, T, d_model]`, the cache with this call's keys and values
        appended; None when `kv_cache` is None). Pass `{}` as `kv_cache` to start one."""
        if not (_same_tokens(q_src, k_src) and _same_tokens(q_src, v_src)):
            raise ValueError(f"{type(self).__name__} is self-attention: pass one tensor as q_src, k_src and v_src "
                             "(queries, keys and values of the same tokens; cached tokens come from kv_cache)")
        if q_src.dim() != 3 or q_src.shape[-1] != self.input_size:
            raise ValueError(f"q_src has shape {tuple(q_src.shape)}; expected [B, T, d_model={self.input_size}]")
        if kv_cache is not None and not isinstance(kv_cache, dict):
            raise ValueError(f"kv_cache must be None or a dict with 'k' and 'v' (start with {{}}), got "
                             f"{type(kv_cache).__name__}")
        batch, length, _ = q_src.shape
        cache = _DictCache(kv_cache) if kv_cache is not None else None
        past = cache.get_seq_length() if cache is not None else 0
        keep = self._keep_mask(mask, batch, length, past + length, q_src.device)
        if self.position_encoding == "xl" and mask is not None and not torch.compiler.is_compiling():
            future = torch.ones(length, past + length, dtype=torch.bool, device=q_src.device).triu(past + 1)
            if (keep & future).any():
                raise ValueError("mask: SwitchHeadXL's relative positions cover past keys only; a mask that shows a "
                                 "query a later key is not supported (use SwitchHeadRope for bidirectional attention)")
        embeddings = None
        if self.rotary is not None:
            embeddings = self.rotary(q_src, torch.arange(past, past + length, device=q_src.device)[None])
        output, _ = self.attention(q_src, embeddings, keep, cache=cache)
        return output, (cache.state if cache is not None else None)


class SwitchHeadRope(_SwitchHeadDropIn):
    """SwitchHead attention with RoPE on the first `int(rotate_fraction * d_head)` channels of each head: the
    authors' `SwitchHeadRope` (arguments, defaults, forward, initialisation, tensor names) on our layer.

    Beyond theirs: `experts_implementation` (our table; None: the default a model gets), `attn_implementation`
    ("sdpa", "eager", "flex_attention"), an exact KV cache.
    """

    position_encoding = "rope"

    def __init__(self, d_model: int, n_heads: int, n_experts: int, dropout: float = 0.0, d_head: int | None = None,
                 expert_dropout: float = 0.0, moe_k: int = 2, init_scale: float = 1.0,
                 rotate_fraction: float = 0.5, rope_base: float = 10000, *,
                 experts_implementation: str | None = None, attn_implementation: str = "sdpa"):
        head = d_head or (d_model // n_heads if isinstance(n_heads, int) and n_heads > 0 else 0)
        if head % 2:
            raise ValueError(f"d_head={head} is odd: RoPE rotates channel pairs, give an even d_head")
        if not 0.0 < rotate_fraction <= 1.0:
            raise ValueError(f"rotate_fraction must be in (0, 1], got {rotate_fraction!r}")
        if int(rotate_fraction * head) % 2:
            raise ValueError(f"rotate_fraction={rotate_fraction} rotates {int(rotate_fraction * head)} channels of "
                             f"d_head={head}: RoPE rotates channel pairs, give a fraction that makes it even")
        if not rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {rope_base!r}")
        super().__init__(d_model, n_heads, n_experts, dropout, d_head, expert_dropout, moe_k, init_scale,
                         experts_implementation, attn_implementation, partial_rotary_factor=rotate_fraction,
                         rope_parameters={"rope_type": "default", "rope_theta": float(rope_base)})


class SwitchHeadXL(_SwitchHeadDropIn):
    """SwitchHead attention with Transformer-XL relative positions (`pos_to_pk`): the authors' `SwitchHeadXL` on our
    layer. Unlike theirs, `pos_to_pk` is initialised (std init_scale / sqrt(d_model), drawn after the other
    tensors) and cached decoding keeps each query's own position."""

    position_encoding = "xl"

    def __init__(self, d_model: int, n_heads: int, n_experts: int, dropout: float = 0.0, d_head: int | None = None,
                 expert_dropout: float = 0.0, moe_k: int = 2, init_scale: float = 1.0, *,
                 experts_implementation: str | None = None, attn_implementation: str = "sdpa"):
        super().__init__(d_model, n_heads, n_experts, dropout, d_head, expert_dropout, moe_k, init_scale,
                         experts_implementation, attn_implementation)

    @property
    def pos_to_pk(self) -> torch.Tensor:
        return self.attention.position_key_proj.weight

    @torch.no_grad()
    def reset_parameters(self, init_scale: float) -> None:
        super().reset_parameters(init_scale)
        nn.init.normal_(self.pos_to_pk, 0.0, init_scale / math.sqrt(self.input_size))
