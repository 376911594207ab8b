"""What a step should cost: FLOPs and bytes from a configuration, the device's measured ceilings, and the kernels a
profiled step ran. The GPU benchmarks (bench_long_context.py, bench_decode_floor.py) print each figure beside the
ideal these give; on its own it prints the predicted table on any machine:

    python benchmarks/roofline.py                    # predicted SwitchHead / dense ratios for the GPU matrices
    python benchmarks/roofline.py --json out.json    # the same, as JSON

It also counts the aten ops (each at least one kernel launch in eager PyTorch) of one attention block, dense and
SwitchHead, forward and backward, and the bytes its backward keeps (`attention_ops`, on the CPU under autocast).

The model (all counts per token, forward; a training step is 3x forward, the usual model-FLOPs convention, which
leaves out flash attention's recomputation in its backward):
- Q and K: 2 x 2 * d * H * dh; values and output: dense 2 x 2 * d * H * dh, SwitchHead's useful work
  2 x 2 * H * k * d * dh (k of E experts per head) plus its two routers, 2 x 2 * d * H * E;
- the attention core, causal: 2 x 2 * H * dh * (T + 1) / 2 (scores and the weighted sum over the keys before
  each query); Transformer-XL's relative-position term adds one more scores product;
- the MLP: 2 * 2 * d * d_ff (dense), or sigma-MoE's 2 * 2 * d * k * g plus its router 2 * d * E;
- the output layer: 2 * d * V.
Decoding one token per row reads every weight once (bf16) and the whole key-value cache of the batch: the HBM floor
is those bytes over the measured copy bandwidth. A static cache is read to its allocated length, so the floor counts
that length.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class LayerCost:
    """Forward FLOPs per token of one layer, by part."""

    qk: float
    value_output: float
    routers: float
    core: float
    mlp: float

    @property
    def total(self) -> float:
        return self.qk + self.value_output + self.routers + self.core + self.mlp


def layer_cost(config, context: int) -> LayerCost:
    """Forward FLOPs per token of one decoder layer of `config` at causal context `context` (mean key count
    (context + 1) / 2)."""
    d, heads, dh = config.hidden_size, config.num_attention_heads, config.head_dim
    inner = heads * dh
    switchhead = config.attention_type == "switchhead"
    if switchhead:
        experts, k = config.num_attention_experts, config.num_attention_experts_per_tok
        side = {"value_output": 2, "value": 1, "output": 1}[getattr(config, "attention_expert_projections",
                                                                    "value_output")]
        value_output = side * 2 * heads * k * d * dh + (2 - side) * 2 * d * inner
        routers = side * 2 * d * heads * experts
    else:
        value_output, routers = 2 * 2 * d * inner, 0.0
    keys = (context + 1) / 2
    products = 3 if config.position_encoding == "xl" else 2  # XL: content, position and the weighted sum
    core = products * 2 * heads * dh * keys
    if getattr(config, "mlp_type", "dense") == "sigma_moe":
        mlp = 2 * 2 * d * config.num_mlp_experts_per_tok * config.mlp_expert_size + 2 * d * config.num_mlp_experts
    else:
        mlp = 2 * 2 * d * config.intermediate_size
    return LayerCost(qk=2 * 2 * d * inner, value_output=value_output, routers=routers, core=core, mlp=mlp)


def training_flops(config, batch: int, context: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) over batch x context tokens."""
    return 3.0 * forward_flops(config, batch, context)


def forward_flops(config, batch: int, context: int) -> float:
    """Model FLOPs of a forward pass (a prefill) over batch x context tokens."""
    per_token = config.num_hidden_layers * layer_cost(config, context).total
    return (per_token + 2 * config.hidden_size * config.vocab_size) * batch * context


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_cache_bytes(config, batch: int, length: int, element_bytes: int = 2) -> int:
    """Keys and values of every layer for `batch` rows of `length` positions."""
    return 2 * config.num_hidden_layers * batch * kv_heads(config) * length * config.head_dim * element_bytes


def weight_bytes(parameters: int, input_embedding: int, element_bytes: int = 2) -> int:
    """Bytes a decoding step reads of the weights: all of them but the input embedding table (one row per token)."""
    return (parameters - input_embedding) * element_bytes


def decode_bytes(config, parameters: int, input_embedding: int, batch: int, cache_length: int) -> int:
    """The fewest HBM bytes one decoding step (one token per row) must read."""
    return weight_bytes(parameters, input_embedding) + kv_cache_bytes(config, batch, cache_length)


def parameter_counts(config) -> tuple[int, int]:
    """(all parameters, input embedding parameters) of a model built on the meta device (nothing allocated)."""
    import torch

    from switchhead import SwitchHeadForCausalLM

    with torch.device("meta"):
        model = SwitchHeadForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    if getattr(config, "tie_word_embeddings", False):
        embedding = 0  # the same matrix is the output layer, read in full
    return total, embedding


# ------------------------------------------------------------------------------------------------ on the device
def measure_ceilings(device, size: int = 8192, copy_mib: int = 1024) -> dict:
    """The device's two ceilings, measured: bf16 matmul FLOP/s (a size^3 product, median of 10) and copy bandwidth
    (bytes read plus written per second of a device-to-device copy, median of 10)."""
    import statistics

    import torch

    if device.type != "cuda":
        return dict(matmul_flops=None, copy_bytes_per_s=None)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    src = torch.randn(copy_mib * 2 ** 20 // 4, device=device)
    dst = torch.empty_like(src)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    matmul_s = timed(lambda: a @ b)
    copy_s = timed(lambda: dst.copy_(src))
    result = dict(matmul_flops=2 * size ** 3 / matmul_s, copy_bytes_per_s=2 * src.numel() * 4 / copy_s,
                  matmul_size=size, copy_mib=copy_mib)
    del a, b, src, dst
    torch.cuda.empty_cache()
    return result


def kernel_table(profile, top: int = 25) -> dict:
    """The device kernels of a `torch.profiler` run: how many launches in all, their time, and the `top` kernels by
    time with their counts."""
    rows = []
    for event in profile.key_averages():
        device_time = getattr(event, "self_device_time_total", None)
        if device_time is None:
            device_time = getattr(event, "self_cuda_time_total", 0)
        if getattr(event, "device_type", None) is None or "CUDA" not in str(event.device_type) or not device_time:
            continue
        rows.append(dict(name=event.key[:120], count=event.count, us=device_time))
    rows.sort(key=lambda r: -r["us"])
    return dict(kernels=sum(r["count"] for r in rows), device_us=sum(r["us"] for r in rows), top=rows[:top])


# ------------------------------------------------------------------------------------------------ predicted table
TRAIN_MATRIX = {  # pair -> contexts (65,536 tokens a step)
    "47m-rope": (512, 4096, 16384),
    "262m-rope": (1024, 8192, 16384),
}
# aten ops that only re-describe memory (no kernel runs for them)
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select", "split",
             "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "narrow",
             "_reshape_alias", "lift_fresh"}


def _op_counter():
    """A TorchDispatchMode class whose instances count the aten ops dispatched under them (`ops`, by name; views
    left out)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _VIEW_OPS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    return Count


def _one_layer_model(config, implementation: str | None):
    """A one-layer copy of `config`'s model (sdpa, no dropout, seed 0) in training mode, with `implementation`."""
    import torch

    from switchhead import SwitchHeadForCausalLM

    config = type(config).from_dict(config.to_dict())
    config.num_hidden_layers, config.hidden_dropout = 1, 0.0
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).train()
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model


def attention_ops(config, implementation: str | None, tokens: int = 1024, batch: int = 1) -> dict:
    """One attention block (a layer's `self_attn`: projections, RoPE where the config has it, sdpa) as a training
    step runs it, fp32 weights under bf16 autocast, on the CPU, over `batch` x `tokens` tokens, forward and backward:
    the aten ops it dispatches (views left out; each is at least one kernel launch in eager PyTorch, the count that
    "switchhead_fused" brings towards dense's) and the bytes its backward keeps, parameters and the attention
    core's `[T, T]` tensors left out (the CPU's sdpa keeps its probabilities; flash on a GPU keeps none). Returns
    {"forward": n, "backward": n, "forward_ops": {name: count}, "backward_ops": {name: count}, "saved_bytes": n}."""
    import torch

    Count = _op_counter()
    model = _one_layer_model(config, implementation)
    hidden = torch.randn(batch, tokens, config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None].expand(batch, -1)
    rotary = model.model.rotary_emb
    embeddings = rotary(hidden, positions) if rotary is not None else None
    attention = model.model.layers[0].self_attn
    forward, backward = Count(), Count()
    kept = _Kept(attention)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with forward, kept:
            out, _ = attention(hidden, position_embeddings=embeddings, attention_mask=None)
    saved = sum(nbytes for tensor, nbytes in kept.storages() if not _queries_by_keys(tensor, tokens, tokens))
    with backward:
        out.float().backward(torch.ones(out.shape))
    return dict(forward=sum(forward.ops.values()), backward=sum(backward.ops.values()),
                forward_ops=dict(forward.ops), backward_ops=dict(backward.ops), saved_bytes=saved)


def _queries_by_keys(tensor, queries: int, keys: int) -> bool:
    """Whether `tensor` is one of the attention core's `[B, H, queries, keys]` tensors (probabilities, a float mask):
    four dimensions, not just the last two, since a `[tokens, d]` activation has the same last two where d is the
    token count (262M's d = 1,024 at 1,024 tokens)."""
    return tensor.dim() == 4 and tuple(tensor.shape[-2:]) == (queries, keys)


class _Kept:
    """Context manager recording what autograd saves for the backward of `module`'s forward; `storages()` then gives
    each storage the graph still holds once, as (a tensor saved in it, its bytes), the module's parameters left out.

    A saved tensor is held in a box only the graph refers to, and counted only while that box lives: a tensor saved by
    a node the forward dropped dies with it, and is not counted. Storages are told apart by their data pointer, read
    while every counted one is alive (a freed storage's address, or its C++ object's, may belong to a later one)."""

    def __init__(self, module):
        import torch

        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.records = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda box: box.tensor)

    def _pack(self, tensor):
        import weakref

        box = _Box(tensor)
        self.records.append(weakref.ref(box))
        return box

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def storages(self) -> list:
        alive = [box for box in (reference() for reference in self.records) if box is not None]
        seen, kept = set(), []
        for box in alive:
            storage = box.tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in self.parameters or pointer in seen:
                continue
            seen.add(pointer)
            kept.append((box.tensor, storage.nbytes()))
        return kept


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def xl_attention_ops(config, implementation: str | None, tokens: int, memory: int, gathered: bool = False,
                     batch: int = 1) -> dict:
    """`attention_ops` for an XL attention block reading `memory` positions of XL memory (as every training segment
    after the first does), its mask the model's (`create_xl_memory_mask`). `gathered`: XL's position term by the
    reference gather over distances (`positions.xl_position_bias_gathered`) instead of the relative shift. Returns
    `attention_ops`'s counts, plus "matmuls" and the (queries, keys) tensors the backward keeps, "square_bytes" (the
    position bias handed to sdpa as its float mask, which a GPU's kernel keeps too; the CPU's math kernel also keeps
    its probabilities), and "index_bytes", the integer tensors it keeps."""
    import torch

    from switchhead import positions

    Count = _op_counter()
    model = _one_layer_model(config, implementation)
    config = model.config
    hidden = torch.randn(batch, tokens, config.hidden_size, requires_grad=True)
    past = torch.randn(batch, memory, config.hidden_size)
    mask = positions.create_xl_memory_mask(config, hidden, None, memory)
    attention = model.model.layers[0].self_attn
    forward, backward = Count(), Count()
    kept = _Kept(attention)
    saved = square = index = 0

    reference = positions.xl_position_bias
    if gathered:
        positions.xl_position_bias = positions.xl_position_bias_gathered
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with forward, kept:
                out, _ = attention(hidden, position_embeddings=None, attention_mask=mask, memory=past)
        for tensor, nbytes in kept.storages():
            if not tensor.is_floating_point():
                index += nbytes
            elif _queries_by_keys(tensor, tokens, tokens + memory):
                square += nbytes
            else:
                saved += nbytes
        with backward:
            out.float().backward(torch.ones(out.shape))
    finally:
        positions.xl_position_bias = reference
    matmuls = sum(c.ops.get(op, 0) for c in (forward, backward) for op in ("mm", "bmm", "addmm", "matmul"))
    return dict(forward=sum(forward.ops.values()), backward=sum(backward.ops.values()), matmuls=matmuls,
                forward_ops=dict(forward.ops), backward_ops=dict(backward.ops), saved_bytes=saved,
                square_bytes=square, index_bytes=index)


def xl_op_table(tokens: int = 256, memory: int = 256) -> list[dict]:
    """`xl_attention_ops` of the 47M XL pair at its paper context: dense, SwitchHead per projection ("eager") and
    lean ("switchhead_fused", what "switchhead_auto" trains with on a GPU), each with the gather and the shift."""
    from switchhead import SwitchHeadConfig

    import torch

    from switchhead import positions

    rows = []  # the encodings' table built first, so that no row counts building it
    positions.past_sinusoidal_encoding(tokens + memory, SwitchHeadConfig.from_preset("wt103-47m-dense-xl").hidden_size,
                                       torch.float32, torch.device("cpu"))
    for label, preset, implementation in (("dense", "wt103-47m-dense-xl", None),
                                          ("switchhead/eager", "wt103-47m-switchhead-xl", "eager"),
                                          ("switchhead/lean", "wt103-47m-switchhead-xl", "switchhead_fused")):
        config = SwitchHeadConfig.from_preset(preset)
        for term, gathered in (("gather", True), ("shift", False)):
            counts = xl_attention_ops(config, implementation, tokens, memory, gathered)
            heads = config.num_attention_heads
            rows.append(dict(label=label, term=term, heads=heads, forward=counts["forward"],
                             backward=counts["backward"], matmuls=counts["matmuls"],
                             ops_per_head=(counts["forward"] + counts["backward"]) / heads,
                             saved_bytes_per_token=counts["saved_bytes"] / tokens,
                             square_bytes_per_token=counts["square_bytes"] / tokens,
                             index_bytes_per_token=counts["index_bytes"] / tokens,
                             forward_ops=counts["forward_ops"], backward_ops=counts["backward_ops"]))
    return rows


def write_xl_ops(out: Path, tokens: int = 256, memory: int = 256) -> None:
    """`xl_op_table` as JSON at `out` and Markdown beside it, with the machine and commit."""
    import subprocess
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe

    rows = xl_op_table(tokens, memory)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    machine = describe(torch.device("cpu"))
    out.write_text(json.dumps(dict(machine=machine, commit=head, tokens=tokens, memory=memory, rows=rows), indent=1))
    lines = ["# One 47M XL attention block: the position term by a gather or by the relative shift", "",
             f"Counted on the CPU ({machine.get('device') or 'CPU'}; torch {machine['torch']}, commit {head}), bf16 "
             f"autocast with fp32 weights, batch 1 x {tokens} tokens reading {memory} of XL memory, forward and "
             "backward. `python benchmarks/roofline.py --xl-ops OUT` reproduces it. Ops: aten ops dispatched, views "
             "left out; bytes kept for the backward per token: the `[T, M + T]` tensors (the bias sdpa takes as "
             "its float mask, which a GPU's kernel keeps too, and the CPU math kernel's probabilities), the integer "
             "tensors (indices, masks), and the rest. Per head: the ops over the block's heads (dense 10, "
             "SwitchHead 2 wider ones); SwitchHead's routers and expert mixes run once a block whatever its heads, "
             "so its count per head is set by the head count, not by the position term.", "",
             "| block | position term | ops forward + backward | per head | matrix products | [T, M + T] B | "
             "integer B | other B |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['label']} | {row['term']} | {row['forward']} + {row['backward']} | "
                     f"{row['ops_per_head']:.1f} | {row['matmuls']} | {row['square_bytes_per_token']:,.0f} | "
                     f"{row['index_bytes_per_token']:,.0f} | {row['saved_bytes_per_token']:,.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def attention_op_table(tokens: int = 1024) -> list[dict]:
    """`attention_ops` of each pair's dense and SwitchHead attention blocks (per-projection "eager", fused)."""
    rows = []
    for pair in PAIR_PRESETS:
        moe, dense = rope_configs(pair, tokens)
        for label, config, implementation in (("dense", dense, None), ("switchhead/eager", moe, "eager"),
                                              ("switchhead/fused", moe, "switchhead_fused")):
            counts = attention_ops(config, implementation, tokens)
            # per token: what the backward keeps grows with the tokens; the weights' bf16 copies do not
            per_token = (attention_ops(config, implementation, 2 * tokens)["saved_bytes"] - counts["saved_bytes"]) \
                / tokens
            matmuls = sum(counts[f"{side}_ops"].get(op, 0) for side in ("forward", "backward")
                          for op in ("mm", "bmm", "addmm", "matmul"))
            rows.append(dict(pair=pair, label=label, forward=counts["forward"], backward=counts["backward"],
                             matmuls=matmuls, saved_bytes_per_token=per_token))
    return rows


DECODE_MATRIX = ((1, 1024), (32, 1024), (32, 8192), (128, 8192))  # (batch, tokens in the cache)
PAIR_PRESETS = {"47m-rope": ("wt103-45m-switchhead-rope", "wt103-47m-dense-xl"),
                "262m-rope": ("wt103-243m-switchhead-rope", "wt103-262m-dense-xl")}


def rope_configs(pair: str, context: int):
    """(SwitchHead, dense) configurations of a pair with RoPE positions covering `context`."""
    from switchhead import SwitchHeadConfig

    moe, dense = PAIR_PRESETS[pair]
    return (SwitchHeadConfig.from_preset(moe, max_position_embeddings=context),
            SwitchHeadConfig.from_preset(dense, position_encoding="rope", xl_memory_length=0,
                                         max_position_embeddings=context))


def predicted(tokens: int = 65536) -> dict:
    """FLOP ratios of the training matrix and byte ratios of the decode matrix, SwitchHead / dense."""
    train, decode = [], []
    for pair, contexts in TRAIN_MATRIX.items():
        for context in contexts:
            moe, dense = rope_configs(pair, context)
            batch = tokens // context
            f_moe, f_dense = training_flops(moe, batch, context), training_flops(dense, batch, context)
            core = dense.num_hidden_layers * layer_cost(dense, context).core * 3 * batch * context / f_dense
            train.append(dict(pair=pair, context=context, batch=batch, switchhead_flops=f_moe, dense_flops=f_dense,
                              ratio=f_moe / f_dense, dense_core_share=core))
    for pair in PAIR_PRESETS:
        moe, dense = rope_configs(pair, 8192 + 128)
        counts = {kind: parameter_counts(c) for kind, c in (("switchhead", moe), ("dense", dense))}
        for batch, length in DECODE_MATRIX:
            b_moe = decode_bytes(moe, *counts["switchhead"], batch, length)
            b_dense = decode_bytes(dense, *counts["dense"], batch, length)
            decode.append(dict(pair=pair, batch=batch, cache_length=length, switchhead_bytes=b_moe,
                               dense_bytes=b_dense, ratio=b_moe / b_dense,
                               layer_flops={k: asdict(layer_cost(c, length)) for k, c in
                                            (("switchhead", moe), ("dense", dense))}))
    return dict(tokens_per_step=tokens, train=train, decode=decode)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    parser.add_argument("--xl-ops", type=Path, default=None,
                        help="only count one 47M XL attention block (gather against shift) and write it here (JSON "
                             "and Markdown)")
    args = parser.parse_args(argv)
    if args.xl_ops:
        write_xl_ops(args.xl_ops)
        return 0
    table = predicted()
    print("training step, 65,536 tokens: FLOPs SwitchHead / dense (attention core's share of dense)")
    for row in table["train"]:
        print(f"  {row['pair']:>9} T={row['context']:>5}: {row['ratio']:.2f} ({row['dense_core_share']:.0%})")
    print("decoding step, HBM bytes SwitchHead / dense (time at the floor is in proportion)")
    for row in table["decode"]:
        print(f"  {row['pair']:>9} batch {row['batch']:>3} @ {row['cache_length']:>5}: {row['ratio']:.2f} "
              f"({row['switchhead_bytes'] / 2 ** 20:.0f} / {row['dense_bytes'] / 2 ** 20:.0f} MiB)")
    table["attention_ops"] = attention_op_table()
    print("one attention block, batch 1 x 1,024 tokens, bf16 autocast: aten ops (views left out) forward + backward, "
          "of them matrix products; bytes its backward keeps per token")
    for row in table["attention_ops"]:
        print(f"  {row['pair']:>9} {row['label']:<17}: {row['forward']} + {row['backward']}, {row['matmuls']}; "
              f"{row['saved_bytes_per_token']:,.0f} B")
    table["xl_attention_ops"] = xl_op_table()
    print("one 47M XL attention block, batch 1 x 256 tokens and 256 of memory, bf16 autocast: aten ops forward + "
          "backward (per head), matrix products; bytes its backward keeps per token: besides the [T, M + T] tensors, "
          "those, and integer indices")
    for row in table["xl_attention_ops"]:
        print(f"  {row['label']:<17} {row['term']:<6}: {row['forward']} + {row['backward']} "
              f"({row['ops_per_head']:.1f} per head), {row['matmuls']}; {row['saved_bytes_per_token']:,.0f} B, "
              f"{row['square_bytes_per_token']:,.0f} B, {row['index_bytes_per_token']:,.0f} B")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
