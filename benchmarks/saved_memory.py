"""What a training step keeps for its backward, part by part: SwitchHead against its dense baseline.

    python benchmarks/saved_memory.py [--context 512] [--batch 2]

For the 47M pairs of bench_model.py (RoPE and XL, fp32, sdpa, training mode, dropout off), one forward of the LM
loss under `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd keeps for the backward. Each
storage is counted once (views share it), parameters are left out (they are there anyway), and the bytes are given
to the outermost part of the model that was running when they were saved: the attention layers, the MLPs, the
LayerNorms, or the rest (embedding, LM head, loss, residual additions). This is deterministic, unlike the resident
set that bench_model.py's peak memory follows, and it says which part a memory ratio can move: SwitchHead changes
only the attention, and the MLP, LayerNorms and logits are the same in both models of a pair. JSON + Markdown go to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
from machine import describe  # noqa: E402

from switchhead.modeling_switchhead import SigmaMoeMLP, SwitchHeadAttentionBase, SwitchHeadMLP  # noqa: E402

PARTS = ("attention", "mlp", "layernorm", "rest")
RESULTS = Path(__file__).resolve().parent / "results"


def part_of(module: nn.Module) -> str | None:
    if isinstance(module, SwitchHeadAttentionBase):
        return "attention"
    if isinstance(module, (SwitchHeadMLP, SigmaMoeMLP)):
        return "mlp"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    return None


def saved_bytes(model: nn.Module, batch: int, context: int, autocast: bool = False, memory: int = 0,
                square: dict | None = None, fused_sdpa: dict | None = None) -> dict[str, int]:
    """Bytes autograd saves in one training forward of `model`, by part (see the module docstring). `autocast`: under
    bf16 autocast on the CPU, fp32 weights (what a GPU step runs). `memory`: an XL model reads `memory` positions of
    XL memory per layer, as every segment after the first does in training. `square`: where given, the tensors whose
    last two dimensions are (queries, keys) (the attention core's probabilities, XL's position bias and its index)
    go to `square[part]` instead of the part. `fused_sdpa`: where given, sdpa is counted as a GPU's fused kernel
    keeps it (its query, key, value and output, and a float32 log-sum-exp per query and head), and the bytes the
    CPU's kernel keeps besides (the math kernel's float32 copies of query, key and value, which it runs where the
    float mask needs a gradient: XL's position bias) go to `fused_sdpa[part]`."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    records = []  # (weak reference to what autograd holds, part), in the order saved
    running: list[str] = []  # parts entered and not yet left, outermost first
    hooks = []
    in_sdpa = []  # the sdpa call running, if any: its pack records go to `inside`
    inside = []  # (weak reference, part) saved within an sdpa call
    fused_keeps = []  # (tensors a fused kernel keeps, log-sum-exp bytes, part) of each sdpa call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(query, key, value, *args, **kwargs):
        if torch.is_autocast_enabled("cpu"):  # autocast's own casts, made here so that the kept copies are known
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        in_sdpa.append(True)
        try:
            out = sdpa(query, key, value, *args, **kwargs)
        finally:
            in_sdpa.pop()
        if out.requires_grad:
            lse = 4 * query.numel() // query.shape[-1]  # float32, one per query and head
            fused_keeps.append(((query, key, value, out), lse, running[0] if running else "rest"))
        return out

    def enter(module, args):
        running.append(part_of(module))

    def leave(module, args, output):
        running.pop()  # returns None: the output stays as it is

    for module in model.modules():
        if part_of(module) is not None:
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor):
        # Held in a box that only the graph refers to: a tensor saved by a node the forward later drops (a branch
        # whose result is not used) dies with it, and is not counted; its memory, reused by a later tensor, would
        # otherwise hide that tensor behind the same address.
        box = _Saved(tensor)
        (inside if in_sdpa else records).append((weakref.ref(box), running[0] if running else "rest"))
        return box

    ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    extra = {}
    if memory:
        config = model.config
        extra["xl_memory"] = [torch.randn(batch, memory, config.hidden_size, generator=torch.Generator().manual_seed(1))
                              for _ in range(config.num_hidden_layers)]
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if fused_sdpa is not None:  # else no call is told apart: every record goes to `records`
        torch.nn.functional.scaled_dot_product_attention = counted_sdpa
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False, **extra).loss
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for hook in hooks:
            hook.remove()
    by_part = dict.fromkeys(PARTS, 0)
    seen: set[int] = set()
    alive = [(box, part) for box, part in ((reference(), part) for reference, part in records) if box is not None]
    kept_inside = [(box.tensor, part) for box, part in ((r(), part) for r, part in inside) if box is not None]
    if fused_sdpa is not None:  # what a fused kernel keeps of each call
        alive += [(_Saved(tensor), part) for tensors, _, part in fused_keeps for tensor in tensors]
    for box, part in alive:  # what the graph still holds, each storage once
        storage = box.tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in parameters or pointer in seen:
            continue
        seen.add(pointer)
        if square is not None and _queries_by_keys(box.tensor, context, context + memory):
            square[part] = square.get(part, 0) + storage.nbytes()
        else:
            by_part[part] += storage.nbytes()
    if fused_sdpa is not None:
        for _, lse, part in fused_keeps:
            by_part[part] += lse
        for tensor, part in kept_inside:  # the CPU kernel's own: besides the above and the probabilities
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in parameters or pointer in seen:
                continue
            seen.add(pointer)
            if square is not None and _queries_by_keys(tensor, context, context + memory):
                square[part] = square.get(part, 0) + storage.nbytes()
            else:  # the math kernel's float32 copies; the CPU kernel's own log-sum-exp (counted above)
                fused_sdpa[part] = fused_sdpa.get(part, 0) + storage.nbytes()
    del alive, kept_inside, fused_keeps
    loss.backward()  # the recorded graph is complete: it runs
    return by_part


def _queries_by_keys(tensor: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether `tensor` is one of the attention core's `[B, H, queries, keys]` tensors: four dimensions, since a
    `[tokens, d]` activation has the same last two where d equals the token count."""
    return tensor.dim() == 4 and tuple(tensor.shape[-2:]) == (queries, keys)


class _Saved:
    """A tensor autograd saved, as the graph holds it (see `saved_bytes`)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


# ------------------------------------------------------------------------------------------------ per token
# What a GPU step keeps, counted on the CPU: bytes per token by part, fp32 and bf16 autocast (fp32 weights, the
# casting policy CUDA's autocast applies to these ops: matmuls and sdpa in bf16, LayerNorm, softmax and the loss in
# fp32). Each model is measured with 1 and 2 layers at batch 1 and 2: the differences give the bytes per layer and per
# token, the bytes per token outside the layers, and what does not grow with the tokens (autocast's bf16 copies of
# the weights). Nothing else depends on the context: sdpa's fused kernels keep only q, k, v, the output and the
# log-sum-exp per query, so a step's bytes are these per-token bytes times its tokens plus the constant.
FAMILIES = {  # family -> SwitchHead preset, dense preset, paper context, XL memory per layer
    "47m-rope": ("wt103-45m-switchhead-rope", "wt103-47m-dense-xl", 512, 0),
    "262m-rope": ("wt103-243m-switchhead-rope", "wt103-262m-dense-xl", 1024, 0),
    "47m-xl": ("wt103-47m-switchhead-xl", "wt103-47m-dense-xl", 256, 256),
}
# SwitchHead's formulations: "eager" is the per-projection rule ("switchhead_auto" on a CPU, and on a GPU before the
# lean default); "lean" is "switchhead_fused", which "switchhead_auto" trains with on a GPU
FORMULATIONS = {"dense": None, "switchhead/eager": "eager", "switchhead/lean": "switchhead_fused"}
DTYPES = {"fp32": False, "bf16": True}
TRAIN_TOKENS = 65536  # tokens per step of the GPU matrices
COUNT_CONTEXT = 256  # the context counted at (XL: its paper context, with as much memory); `context_check` shows
# that the bytes per token are the same at four times that


def family_config(family: str, member: str, layers: int):
    from switchhead import SwitchHeadConfig

    moe, dense, context, memory = FAMILIES[family]
    overrides = dict(num_hidden_layers=layers, hidden_dropout=0.0)
    if member == "dense":
        preset = dense
        if memory == 0:
            overrides.update(position_encoding="rope", xl_memory_length=0, max_position_embeddings=context)
    else:
        preset = moe
        if memory == 0:
            overrides.update(max_position_embeddings=context)
    config = SwitchHeadConfig.from_preset(preset, **overrides)
    config._attn_implementation = "sdpa"
    return config


def per_token(family: str, member: str, autocast: bool, context: int | None = None, quick: bool = False,
              share_casts: bool = True) -> dict:
    """Bytes kept for the backward of `member` of `family`: per layer and token by part (`layer`), per token outside
    the layers (`outside`), constant (`constant`, by part), and the (queries, keys) tensors per layer and token
    (`square`, not in the parts: the CPU's sdpa keeps its probabilities where a GPU's fused kernel keeps none). sdpa
    is counted as a GPU's fused kernel keeps it; what the CPU's kernel keeps besides, per layer and token, is
    `cpu_sdpa` (not in the parts: XL's math kernel's float32 copies of query, key and value). `share_casts` False:
    SwitchHead's projections each cast their input for themselves, as before `expert_ops.shared_autocast_inputs`."""
    from switchhead import expert_ops
    from switchhead import SwitchHeadForCausalLM

    _, _, paper, memory = FAMILIES[family]
    context = context or (16 if quick else COUNT_CONTEXT)
    memory = min(memory, context)
    counts = {}
    for layers in (1, 2):
        for batch in (1, 2):
            config = family_config(family, member, layers)
            if quick:
                config.hidden_size, config.intermediate_size, config.vocab_size = 64, 96, 101
            torch.manual_seed(0)
            model = SwitchHeadForCausalLM(config)
            if FORMULATIONS[member] is not None:
                model.set_experts_implementation(FORMULATIONS[member])
            square, cpu_sdpa = {}, {}
            sharing, expert_ops.SHARE_AUTOCAST_INPUTS = expert_ops.SHARE_AUTOCAST_INPUTS, share_casts
            try:
                parts = saved_bytes(model, batch, context, autocast, memory, square, cpu_sdpa)
            finally:
                expert_ops.SHARE_AUTOCAST_INPUTS = sharing
            counts[layers, batch] = parts, sum(square.values()), sum(cpu_sdpa.values())
    tokens = context  # per batch row
    layer = {p: (counts[2, 2][0][p] - counts[2, 1][0][p] - counts[1, 2][0][p] + counts[1, 1][0][p]) / tokens
             for p in PARTS}
    outside = {p: (counts[1, 2][0][p] - counts[1, 1][0][p]) / tokens - layer[p] for p in PARTS}
    constant = {p: counts[1, 1][0][p] - tokens * (layer[p] + outside[p]) for p in PARTS}
    square, cpu_sdpa = ((counts[2, 2][i] - counts[2, 1][i] - counts[1, 2][i] + counts[1, 1][i]) / tokens
                        for i in (1, 2))
    return dict(context=context, memory=memory, layer=layer, outside=outside, constant=constant, square=square,
                cpu_sdpa=cpu_sdpa)


def step_bytes(row: dict, layers: int, tokens: int) -> dict:
    """A whole step's bytes by part from `per_token`'s row: `layers` layers over `tokens` tokens."""
    return {p: tokens * (layers * row["layer"][p] + row["outside"][p]) + row["constant"][p] for p in PARTS}


def parameters_of(family: str, member: str) -> int:
    from switchhead import SwitchHeadForCausalLM

    config = family_config(family, member, FAMILIES_LAYERS[family])
    with torch.device("meta"):
        return sum(p.numel() for p in SwitchHeadForCausalLM(config).parameters())


FAMILIES_LAYERS = {"47m-rope": 16, "262m-rope": 18, "47m-xl": 16}
GPU_MATRIX = RESULTS / "gpu" / "matrices" / "long_train.json"


def gpu_peaks() -> dict:
    """{(family, context, member): (peak bytes, batch)} of the H100 training matrix, members named as here."""
    if not GPU_MATRIX.exists():
        return {}
    peaks = {}
    for group in json.loads(GPU_MATRIX.read_text())["groups"]:
        family, context = group["group"].split("@")
        for member, row in group["members"].items():
            if row.get("peak_bytes"):
                peaks[family, int(context), member] = (row["peak_bytes"], group["batch"])
    return peaks


def token_report(quick: bool, contexts: tuple[int, ...]) -> dict:
    table = {}
    for family in FAMILIES:
        for member in FORMULATIONS:
            for dtype, autocast in DTYPES.items():
                table[f"{family}/{member}/{dtype}"] = per_token(family, member, autocast, quick=quick)
                print(family, member, dtype, {p: round(v) for p, v in table[f"{family}/{member}/{dtype}"]["layer"].items()},
                      flush=True)
    check = {}
    if not quick:  # the same bytes per token at 4x the context counted at
        for member in ("dense", "switchhead/lean"):
            longer = per_token("47m-rope", member, True, context=4 * COUNT_CONTEXT)
            check[f"47m-rope/{member}/bf16"] = dict(
                context=longer["context"], layer=longer["layer"], outside=longer["outside"],
                # the loss predicts T - 1 tokens a row: its bytes per token move by under 1 / T of a logits row
                same=all(abs(longer[k][p] - table[f"47m-rope/{member}/bf16"][k][p]) < 0.5
                         for k in ("layer", "outside") for p in PARTS))
            print("check", member, check[f"47m-rope/{member}/bf16"]["same"], flush=True)
    steps, predicted, as_measured = {}, [], {}
    peaks = gpu_peaks()
    for family, (_, _, paper, _) in FAMILIES.items():
        layers = 2 if quick else FAMILIES_LAYERS[family]
        for context in (contexts if FAMILIES[family][3] == 0 else (paper,)):
            for member in FORMULATIONS:
                for dtype in DTYPES:
                    parts = step_bytes(table[f"{family}/{member}/{dtype}"], layers, TRAIN_TOKENS)
                    steps[f"{family}@{context}/{member}/{dtype}"] = parts
            if quick:
                continue
            for member in ("dense", "switchhead/eager"):
                # the GPU matrix's XL steps carry no memory across segments: not the step counted here
                peak = peaks.get((family, context, member)) if FAMILIES[family][3] == 0 else None
                if peak is None:
                    continue
                tokens = peak[1] * context
                state = 16 * parameters_of(family, member)  # fp32 weights, gradients, AdamW's two moments
                row = table[f"{family}/{member}/bf16"]
                if member != "dense":  # the code the H100 ran: each projection cast its input for itself
                    if (family, member) not in as_measured:
                        as_measured[family, member] = per_token(family, member, True, share_casts=False)
                    row = as_measured[family, member]
                saved = sum(step_bytes(row, layers, tokens).values())
                predicted.append(dict(family=family, context=context, member=member, tokens=tokens, state=state,
                                      saved=saved, predicted=state + saved, measured=peak[0],
                                      measured_over_predicted=peak[0] / (state + saved)))
    return dict(per_token=table, context_check=check, steps=steps, predicted_gpu_peak=predicted)


TARGETS = {  # (family, row) -> the most SwitchHead / dense may keep (bf16 autocast, the default formulation)
    ("47m-rope", "attention"): 0.55, ("262m-rope", "attention"): 0.40, ("47m-xl", "attention"): 0.35,
    ("47m-rope", 512): 0.92, ("262m-rope", 1024): 0.85, ("47m-xl", 256): 0.50,
    ("47m-rope", 16384): 0.85, ("262m-rope", 16384): 0.80,
}


def token_markdown(report: dict) -> str:
    table, steps = report["per_token"], report["steps"]
    machine = report["machine"]
    lines = ["# Kept for the backward per token, by part: SwitchHead against dense", "",
             f"Counted on the CPU ({machine.get('device') or machine.get('cpu') or 'CPU'}; torch {machine['torch']}, "
             f"commit {report['commit']}): fp32, and bf16 autocast with fp32 weights, the casting policy a GPU step "
             "runs under. `python benchmarks/saved_memory.py --per-token` reproduces it. Bytes per token and layer "
             "(attention, MLP, LayerNorms), per token outside the layers (the final LayerNorm, embedding, logits and "
             "loss), each storage once, parameters left out. sdpa is counted as a GPU's fused kernel keeps it: its "
             "query, key, value and output, and a float32 log-sum-exp per query and head; what the CPU's kernel "
             "keeps besides is left out: the (queries, keys) probabilities, and (the last column, per layer and "
             "token) its own log-sum-exp and, where XL's position bias needs a gradient (the CPU then runs sdpa's "
             "math kernel), float32 copies of query, key and value. \"lean\" is \"switchhead_fused\", what \"switchhead_auto\" trains "
             "SwitchHead's attention with on a GPU; \"eager\" the per-projection rule (the CPU's default, and the "
             "GPU's before). Dense attention is counted as autocast runs it (each projection casts its input for "
             "itself); SwitchHead's projections share one bf16 copy of each input of the layer "
             "(`expert_ops.shared_autocast_inputs`).", "",
             "| model | dtype | attention / layer | MLP / layer | LayerNorms / layer | outside the layers | "
             "weight copies (MiB) | besides, CPU sdpa's own / layer |", "|---|---|---|---|---|---|---|---|"]
    for key, row in table.items():
        family, member, dtype = key.rsplit("/", 1)[0].split("/", 1)[0], key.split("/", 1)[1].rsplit("/", 1)[0], \
            key.rsplit("/", 1)[1]
        lines.append(f"| {family} {member} | {dtype} | {row['layer']['attention']:,.0f} | {row['layer']['mlp']:,.0f} "
                     f"| {row['layer']['layernorm']:,.0f} | {sum(row['outside'].values()):,.0f} | "
                     f"{sum(row['constant'].values()) / 2 ** 20:.1f} | {row.get('cpu_sdpa', 0):,.0f} |")
    lines += ["", f"SwitchHead / dense: the attention block (per layer and token), and a whole step of "
              f"{TRAIN_TOKENS:,} tokens at each context (per-token bytes do not depend on it; the constant does "
              "not grow with the tokens). Target: bf16, the lean default.", "",
              "| family | row | fp32 eager | fp32 lean | bf16 eager | bf16 lean | target |", "|---|---|---|---|---|---|---|"]
    for family in FAMILIES:
        cells = []
        for dtype in DTYPES:
            for member in ("switchhead/eager", "switchhead/lean"):
                cells.append(table[f"{family}/{member}/{dtype}"]["layer"]["attention"]
                             / table[f"{family}/dense/{dtype}"]["layer"]["attention"])
        lines.append(f"| {family} | attention block | " + " | ".join(f"{c:.3f}" for c in cells) + " | "
                     + _target(family, "attention", cells[-1]) + " |")
        for key in steps:
            if not key.startswith(family + "@") or not key.endswith("/dense/fp32"):
                continue
            context = int(key.split("@")[1].split("/")[0])
            cells = []
            for dtype in DTYPES:
                dense = sum(steps[f"{family}@{context}/dense/{dtype}"].values())
                for member in ("switchhead/eager", "switchhead/lean"):
                    cells.append(sum(steps[f"{family}@{context}/{member}/{dtype}"].values()) / dense)
            lines.append(f"| {family} | step at {context:,} | " + " | ".join(f"{c:.3f}" for c in cells) + " | "
                         + _target(family, context, cells[-1]) + " |")
    lines += floor_lines(report)
    if report["predicted_gpu_peak"]:
        lines += ["", "Predicted peak of the H100's training matrix (benchmarks/results/gpu/matrices/long_train.json): "
                  "16 bytes per parameter (fp32 weights, gradients and AdamW's two moments) plus the bf16 bytes kept "
                  "for the backward of its tokens, against the peak it measured. SwitchHead's are counted as the "
                  "H100 ran it, each projection casting its input for itself.", "",
                  "| cell | tokens | state GiB | kept GiB | predicted GiB | measured GiB | measured / predicted |",
                  "|---|---|---|---|---|---|---|"]
        gib = 2 ** 30
        for row in report["predicted_gpu_peak"]:
            lines.append(f"| {row['family']}@{row['context']} {row['member']} | {row['tokens']:,} | "
                         f"{row['state'] / gib:.2f} | {row['saved'] / gib:.2f} | {row['predicted'] / gib:.2f} | "
                         f"{row['measured'] / gib:.2f} | {row['measured_over_predicted']:.3f} |")
    return "\n".join(lines) + "\n"


def attention_floor(family: str) -> float:
    """The fewest bytes per token and layer SwitchHead's attention block can keep under bf16 autocast: the bf16
    inputs of its matrix products that its backward needs, nothing else: the sources (memory and current tokens, read
    by the keys, the values and the value router), the queries, keys and values the attention kernel keeps, and the
    output projection's input (its routers' gates and indices left out)."""
    config = family_config(family, "switchhead", 1)
    _, _, context, memory = FAMILIES[family]
    sources = (memory + context) / context  # source tokens per query token
    inner = config.num_attention_heads * config.head_dim
    return 2 * (sources * config.hidden_size + inner + 2 * sources * inner + inner)


def floor_lines(report: dict) -> list[str]:
    """Why a missed target cannot be met, from the counts: the bf16 lean default against dense."""
    table, lines = report["per_token"], []
    if report.get("quick"):  # the smoke run's models are not the presets the floor is computed from
        return lines
    for (family, row), target in TARGETS.items():
        if family not in FAMILIES or f"{family}/dense/bf16" not in table:
            continue
        dense, lean = table[f"{family}/dense/bf16"], table[f"{family}/switchhead/lean/bf16"]
        layers = FAMILIES_LAYERS[family]
        floor = attention_floor(family)
        if row == "attention":
            if lean["layer"]["attention"] / dense["layer"]["attention"] <= target:
                continue
            allowed = target * dense["layer"]["attention"]
            lines.append(f"- {family}, attention block <= {target}: dense keeps {dense['layer']['attention']:,.0f} B "
                         f"per token and layer, so SwitchHead may keep {allowed:,.0f} B; the inputs of its matrix "
                         f"products alone (bf16 sources, queries, keys, values and the output side's input, before "
                         f"its routers' gates and indices and the kernel's output) are {floor:,.0f} B ({floor / dense['layer']['attention']:.3f} of dense): "
                         + ("it cannot be met." if floor > allowed else "not excluded by this count."))
            continue
        def step(member_row, attention=None):
            per_layer = sum(member_row["layer"].values()) if attention is None else \
                attention + sum(v for p, v in member_row["layer"].items() if p != "attention")
            return layers * per_layer + sum(member_row["outside"].values())
        if step(lean) / step(dense) <= target:
            continue
        allowed = (target * step(dense) - step(lean, 0.0)) / layers
        text = (f"- {family}, whole step at {row:,} <= {target}: the MLP, LayerNorms and what lies outside the layers "
                f"keep about as much in both models; with no attention bytes at all SwitchHead would keep "
                f"{step(lean, 0.0) / step(dense):.3f} of dense")
        if allowed < 0:
            text += ": it cannot be met."
        else:
            text += (f", so its attention may keep {allowed:,.0f} B per token and layer, against a least of "
                     f"{floor:,.0f} B (the inputs of its matrix products): "
                     + ("it cannot be met." if floor > allowed else "not excluded by this count."))
        lines.append(text)
    if lines:
        lines = ["", "Targets missed, from the counts (bf16, per token; the whole step's per-token bytes, constant "
                 "left out):", ""] + lines
    return lines


def _target(family, row, value) -> str:
    target = TARGETS.get((family, row))
    if target is None:
        return ""
    return f"<= {target}: {'met' if value <= target else 'missed'}"


def commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2-layer models (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "saved_memory_cpu.json")
    parser.add_argument("--per-token", action="store_true",
                        help="bytes per token by part, fp32 and bf16 autocast, every family and formulation "
                             "(to benchmarks/results/saved_memory_tokens_cpu.*)")
    args = parser.parse_args(argv)
    if args.context < 1 or args.batch < 1:
        parser.error("--context and --batch must be at least 1")
    if args.per_token:
        report = dict(machine=describe(torch.device("cpu")), commit=commit(), quick=args.quick,
                      train_tokens=TRAIN_TOKENS, **token_report(args.quick, (512, 1024, 4096, 8192, 16384)))
        out = args.out if args.out != RESULTS / "saved_memory_cpu.json" else RESULTS / "saved_memory_tokens_cpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        text = token_markdown(report)
        out.with_suffix(".md").write_text(text)
        print(text)
        return 0
    torch.set_num_threads(1)
    saved = {}
    for moe, dense in bench_model.PAIRS.values():
        for name in (moe, dense):
            saved[name] = saved_bytes(bench_model.build(name, args.quick, "sdpa"), args.batch, args.context)
    ratios = {}
    for family, (moe, dense) in bench_model.PAIRS.items():
        ratios[family] = {part: saved[moe][part] / saved[dense][part] if saved[dense][part] else None for part in PARTS}
        ratios[family]["total"] = sum(saved[moe].values()) / sum(saved[dense].values())
    report = dict(machine=describe(torch.device("cpu")), batch=args.batch, context=args.context, quick=args.quick,
                  saved_bytes=saved, ratios=ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    mib = 2 ** 20
    lines = ["# Saved for the backward, by part of the model", "",
             f"One training forward, batch {args.batch} x {args.context}, fp32, sdpa, dropout off"
             f"{', 2-layer models' if args.quick else ''}; torch {report['machine']['torch']}. MiB autograd keeps "
             "(each storage once, parameters left out), by the outermost part running when it was saved.", "",
             "| model | " + " | ".join(PARTS) + " | total |", "|---|" + "---|" * (len(PARTS) + 1)]
    for name, parts in saved.items():
        lines.append(f"| {name} | " + " | ".join(f"{parts[p] / mib:.0f}" for p in PARTS)
                     + f" | {sum(parts.values()) / mib:.0f} |")
    lines += ["", "| SwitchHead / dense | " + " | ".join(PARTS) + " | total |", "|---|" + "---|" * (len(PARTS) + 1)]
    for family, row in ratios.items():
        lines.append(f"| {family} | " + " | ".join("n/a" if row[p] is None else f"{row[p]:.2f}"
                                                   for p in PARTS + ("total",)) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
