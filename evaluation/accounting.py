"""MAC and memory accounting of SwitchHead / dense attention, as the paper's tables were computed (`switchhead flops`).

All counts are per layer and per sequence of `T` tokens (the paper's unit). `C` is 1 plus the number of
memory chunks each query can also attend to (2 for the paper's Transformer-XL models, which attend to one
previous chunk; 1 without memory). Memory counts floats kept for the backward pass, not bytes.

Two SwitchHead MAC formulas exist, and they disagree:

* ``"table"``: what the authors' table script computed (written out in docs/evaluation.md, "MAC and memory
  accounting"). Every MAC / memory number of the paper's tables comes from it. The value and output projections
  are the two MoE projections (`n_exp = 2`), each running k of the E experts of every head; the two selection
  networks score all E experts of every head for all C*T positions; the XL positional projection is counted
  once (T rows) for SwitchHead but C times (C*T rows) for the dense baseline.
* ``"eq13"``: our reading of the equation printed in the paper (its Eq. 13), which gives 200.3M for WT103
  47M (the table says 170.4M): it counts the XL positional projection over all C*T positions,
  like the dense formula, and leaves the selection networks out. Given only as a labelled cross-check.

Memory has only the table formula. The dense baseline has one formula (the same for both labels).

MoEUT (arXiv 2405.16039) counts as its authors' accounting script does: per sequence, every layer application's
attention (the tables' formula above, C = 1 with RoPE) plus its MLP (sigma-MoE: all N_E router scores and K active
experts of 2 * d * expert size each), times the n_layers applications; embedding, norms and the output layer are
not counted (`model_forward_macs(...)["layers"]`). Shared blocks are computed at every application but their
parameters count once (`parameter_counts`).

The value-only / output-only ablation (`attention_expert_projections` "value" or "output", the paper's Table 6)
has one MoE projection and one selection network (`n_exp = n_sel = 1` in the authors' script): the other
projection is a dense d x H*dh matrix, counted like the dense baseline's, with no gate and no selection.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

from .. import SwitchHeadConfig
from ..integrity.loading import parameter_count

FORMULAS = ("table", "eq13")
MOE_PROJECTIONS = 2  # V and O are mixtures of experts (n_exp in the authors' script), by default
SELECTIONS = 2  # W_S (value side) and W_D (output side): n_sel, by default


def moe_projections(config: SwitchHeadConfig) -> int:
    """How many of V and O are mixtures of experts (each with its own selection network): n_exp = n_sel."""
    if config.attention_type != "switchhead":
        return 0
    return len(getattr(config, "attention_expert_routers", ("value", "output")))
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def default_context(config: SwitchHeadConfig) -> int:
    """The sequence length T the paper used for a preset: its training context (`max_position_embeddings`)."""
    return config.max_position_embeddings


def default_memory_chunks(config: SwitchHeadConfig, context: int) -> int:
    """Previous chunks each query also attends to: XL memory length in chunks of `context` (0 for RoPE)."""
    if config.position_encoding != "xl" or config.xl_memory_length == 0:
        return 0
    return math.ceil(config.xl_memory_length / context)


def _shape(config: SwitchHeadConfig, context: int | None, memory_chunks: int | None):
    T = context or default_context(config)
    C = 1 + (default_memory_chunks(config, T) if memory_chunks is None else memory_chunks)
    if T < 1 or C < 1:
        raise ValueError(f"context ({T}) must be >= 1 and memory_chunks ({C - 1}) >= 0")
    return config.hidden_size, config.num_attention_heads, config.head_dim, T, C


def attention_macs(config: SwitchHeadConfig, context: int | None = None, memory_chunks: int | None = None,
                   formula: str = "table") -> int:
    """Multiply-accumulates of one attention layer over one sequence of `context` tokens.

    Args:
        config: the model configuration (SwitchHead or dense attention, RoPE or XL positions).
        context: sequence length T; defaults to `config.max_position_embeddings`.
        memory_chunks: previous chunks attended to (C - 1); defaults to the XL memory of the config.
        formula: "table" (the paper's tables) or "eq13" (the printed equation); see the module docstring.
    """
    if formula not in FORMULAS:
        raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")
    d, H, dh, T, C = _shape(config, context, memory_chunks)
    xl = config.position_encoding == "xl"
    attention_matrices = 2 * H * dh * T * T * C  # Q K^T and A V, over the C*T visible keys
    if config.attention_type == "dense":
        # Q, K, V, O projections; XL positional projection over all C*T relative positions
        return attention_matrices + 4 * d * H * dh * T + (2 * H * d * T * dh * C if xl else 0)
    E, k = config.num_attention_experts, config.num_attention_experts_per_tok
    moe = moe_projections(config)  # 2 (V and O), or 1 with a dense V or O (the ablation)
    projections = (moe * k + 4 - moe) * d * H * dh * T  # dense Q, K (and V or O); k experts of the MoE ones
    gating = moe * H * k * T * dh  # scaling the k expert outputs by their gates
    if formula == "table":
        selection = moe * E * d * T * C
        positional = 2 * H * d * T * dh if xl else 0
        return attention_matrices + projections + gating + selection + positional
    positional = 2 * H * d * T * dh * C if xl else 0
    return attention_matrices + projections + gating + positional


def attention_memory(config: SwitchHeadConfig, context: int | None = None, memory_chunks: int | None = None) -> int:
    """Floats one attention layer keeps per sequence (the paper's "Mem" column; table formula)."""
    _, H, dh, T, C = _shape(config, context, memory_chunks)
    xl = config.position_encoding == "xl"
    attention_matrices = 2 * H * T * T * C  # logits and probabilities
    projections = 4 * H * dh * T  # q, k, v, attention output
    if config.attention_type == "dense":
        return attention_matrices + projections + (2 * H * T * dh * C if xl else 0)
    selection = moe_projections(config) * config.num_attention_experts * T * C
    return attention_matrices + projections + selection + (2 * H * T * dh if xl else 0)


def mlp_macs(config: SwitchHeadConfig, tokens: int) -> int:
    """Feed-forward MACs for `tokens` tokens: dense ReLU MLP, or sigma-MoE (selection + k active experts)."""
    d = config.hidden_size
    if config.mlp_type == "sigma_moe":
        return tokens * (config.num_mlp_experts * d
                         + config.num_mlp_experts_per_tok * 2 * d * config.mlp_expert_size)
    return tokens * 2 * d * config.intermediate_size


def model_forward_macs(config: SwitchHeadConfig, context: int | None = None,
                       memory_chunks: int | None = None) -> dict[str, int]:
    """Whole-model forward MACs for one sequence: layers x (attention [table formula] + MLP) + output layer.

    `num_hidden_layers` counts layer applications (MoEUT's shared blocks run at each); "layers" leaves the output
    layer out, as the MoEUT authors' accounting does."""
    T = context or default_context(config)
    attention = attention_macs(config, T, memory_chunks)
    mlp = mlp_macs(config, T)
    lm_head = T * config.hidden_size * config.vocab_size
    layers = config.num_hidden_layers * (attention + mlp)
    total = layers + lm_head
    return {"attention_per_layer": attention, "mlp_per_layer": mlp, "layers": layers, "lm_head": lm_head,
            "total": total, "per_token": total // T}


def parameter_counts(config: SwitchHeadConfig) -> dict[str, int]:
    """Parameters: "total" (each distinct block once, as `save_pretrained` stores them), "per_block", the
    "distinct_blocks" (`layer_group_size`, else `num_hidden_layers`) and "outside_blocks" (embedding, final norm,
    output layer). Counted on the meta device from models of one and two blocks."""
    def blocks(count: int) -> int:
        small = copy.deepcopy(config)
        small.num_hidden_layers, small.layer_group_size = count, None
        return parameter_count(small)

    one, two = blocks(1), blocks(2)
    per_block = two - one
    distinct = int(getattr(config, "layer_group_size", None) or config.num_hidden_layers)
    return {"total": one - per_block + distinct * per_block, "per_block": per_block, "distinct_blocks": distinct,
            "outside_blocks": one - per_block}


def kv_cache_bytes_per_token(config: SwitchHeadConfig, dtype: str = "float32") -> int:
    """Bytes the generation cache grows by per token: K and the already expert-mixed V, [H, dh] per layer.

    SwitchHead caches values after the expert mixture, so its cache is that of a dense model with H heads.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * DTYPE_BYTES[dtype]


@dataclass
class CostReport:
    context: int
    memory_chunks: int
    attention_macs_table: int
    attention_macs_eq13: int | None
    attention_memory_table: int
    model_forward_macs: dict
    kv_cache_bytes_per_token: int
    kv_cache_dtype: str
    parameters: dict

    def as_dict(self) -> dict:
        return asdict(self)


def cost_report(config: SwitchHeadConfig, context: int | None = None, memory_chunks: int | None = None,
                dtype: str = "float32") -> CostReport:
    T = context or default_context(config)
    C = default_memory_chunks(config, T) if memory_chunks is None else memory_chunks
    switchhead = config.attention_type == "switchhead"
    return CostReport(
        context=T,
        memory_chunks=C,
        attention_macs_table=attention_macs(config, T, C, "table"),
        attention_macs_eq13=attention_macs(config, T, C, "eq13") if switchhead else None,
        attention_memory_table=attention_memory(config, T, C),
        model_forward_macs=model_forward_macs(config, T, C),
        kv_cache_bytes_per_token=kv_cache_bytes_per_token(config, dtype),
        kv_cache_dtype=dtype,
        parameters=parameter_counts(config),
    )


def format_count(value: float) -> str:
    """The paper's table style: millions below 1000M, else billions, one decimal (0.8M, 170.4M, 2.4G)."""
    if abs(value) >= 1e9:
        return f"{value / 1e9:.1f}G"
    if abs(value) >= 1e4:
        return f"{value / 1e6:.1f}M"
    return f"{value:,.0f}"


def shared_layers_lines(config: SwitchHeadConfig) -> list[str]:
    """MoEUT's shared layers: compute and the KV cache count every application, parameters only the distinct
    blocks (the report's per-layer figures are per application)."""
    group = getattr(config, "layer_group_size", None)
    if group is None:
        return []
    return [f"shared layers (MoEUT): {group} distinct blocks applied {config.num_hidden_layers // group} times = "
            f"{config.num_hidden_layers} layer applications; MACs and KV cache count every application, parameters "
            f"each distinct block once"]


def format_report(name: str, config: SwitchHeadConfig, report: CostReport) -> str:
    attention = "SwitchHead" if config.attention_type == "switchhead" else "dense"
    head = (f"{name}: {attention} attention, {config.position_encoding.upper()} positions, d={config.hidden_size}, "
            f"H={config.num_attention_heads}, dh={config.head_dim}")
    if config.attention_type == "switchhead":
        head += f", E={config.num_attention_experts}, k={config.num_attention_experts_per_tok}"
        sides = getattr(config, "attention_expert_projections", "value_output")
        if sides != "value_output":
            head += f", experts on {sides} only"
    forward = report.model_forward_macs
    lines = [head] + shared_layers_lines(config) + [
        f"per layer, per sequence of T={report.context} tokens, C={1 + report.memory_chunks} "
        f"(1 + {report.memory_chunks} memory chunk{'s' if report.memory_chunks != 1 else ''}):",
        f"  attention MACs    {format_count(report.attention_macs_table):>9}  "
        f"({report.attention_macs_table:,})  [paper tables' formula]",
    ]
    if report.attention_macs_eq13 is not None:
        lines.append(f"  attention MACs    {format_count(report.attention_macs_eq13):>9}  "
                     f"({report.attention_macs_eq13:,})  [printed Eq. 13; not what the tables used]")
    lines += [
        f"  attention memory  {format_count(report.attention_memory_table):>9}  "
        f"({report.attention_memory_table:,} floats)  [paper tables' formula]",
        "whole model, forward, one sequence (attention by the tables' formula):",
        f"  MLP per layer     {format_count(forward['mlp_per_layer']):>9}",
        f"  output layer      {format_count(forward['lm_head']):>9}",
        f"  total             {format_count(forward['total']):>9}  ({forward['total']:,}; "
        f"{format_count(forward['per_token'])} per token)",
    ]
    if getattr(config, "layer_group_size", None) is not None:
        lines.append(f"  MoEUT's count     {format_count(forward['layers']):>9}  ({forward['layers']:,}; "
                     f"{config.num_hidden_layers} layer applications x (attention + MLP), no output layer, "
                     f"as arXiv 2405.16039's authors count)")
    parameters = report.parameters
    lines += [
        f"parameters: {format_count(parameters['total'])} ({parameters['total']:,}) = {parameters['distinct_blocks']} "
        f"{'distinct ' if getattr(config, 'layer_group_size', None) is not None else ''}blocks x "
        f"{parameters['per_block']:,} + {parameters['outside_blocks']:,} outside them (embedding, final norm, output "
        f"layer)",
        f"KV cache: {report.kv_cache_bytes_per_token:,} bytes per token ({report.kv_cache_dtype}, "
        f"{config.num_hidden_layers} layers x K,V x {config.num_attention_heads} heads x {config.head_dim})",
    ]
    return "\n".join(lines)
