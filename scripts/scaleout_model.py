"""A model, not a measurement: training the paper's large SwitchAll (`wt103-259m-switchall-xl`, 259.48M
parameters) on 8 and 64 GPUs under the plans of Transformers' distributed engine, computed from stated assumptions.

    python scripts/scaleout_model.py [--batch 64] [--context 512] [--peak-tflops 989.4] [--sustained 0.4]
                                     [--nvlink-gbs 450] [--ib-gbs 50] [--check benchmarks/results/scaleout_cpu_*.json]

Per GPU and per training step, for each plan (`DistributedConfig` sizes: dp_replicate r, fsdp f, tp t, ep e; N =
r*f*t GPUs), with P parameters of which P_e are the sigma-MoE experts (EP-sharded), P_tail the final norm and LM
head (FSDP keeps them gathered after the forward), P_rep the parameters TP replicates (LayerNorms, the sigma-MoE
routers), b = batch / (r*f) sequences per data-parallel group, T the context, d the hidden size, L the layers,
rho(n) = (n-1)/n:

- state: 16 bytes per parameter held (fp32 master 4, fp32 gradient 4, AdamW moments 8), over the sum of
  ceil(rows / g) * (elements per row) of each parameter's shape after the tp_plan / ep_plan (`local_shape`), g its
  FSDP group (f; efsdp = f*t/e for the experts under EP): FSDP2 shards dim 0 padded to a multiple of g, so about
  (P - P_rep)/(t*f) + P_rep/f parameters where dim 0 divides; plus, in flight, the bf16 copies of two decoder
  layers and the head, and one layer's gradient in bf16 and fp32 (FSDP2
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, Transformers' `fsdp_mixed_precision=True`).
- activations: b * (what autograd saves for one sequence), counted for this implementation in fp32 on CPU with
  benchmarks/saved_memory.py's hooks (one sequence of T tokens, no XL memory), plus the XL memory chunk's extra
  from the paper's memory formula (PAPER.md section 6, C=2 against C=1); in bf16 half of it (an assumption:
  every saved tensor in bf16). Under TP the attention and MLP parts divide by t; LayerNorms and the rest (embedding,
  logits, loss) do not (no sequence parallelism).
- communication, bytes one GPU sends under ring algorithms:
  FSDP all-gathers bf16 parameters (layers and embedding twice, forward and backward; the tail once) and
  reduce-scatters fp32 gradients: rho(f) * [2 * (2*(G - G_tail) + G_tail) + 4 * G], G the elements one TP rank's
  FSDP group gathers (its parameters, P without EP and P - P_e with it, on their TP-local shapes, dim 0 padded to a
  multiple of f); replicas (r > 1) all-reduce their gradient shard: 2*rho(r) * 4 * G / f. Under EP the experts form
  their own FSDP group of efsdp = f*t/e GPUs holding P_e/e:
  the same formulas with P_e/e and efsdp, and the all-to-alls: 4 per layer (dispatch and combine, forward and
  backward) of b*T*k*d bf16 values each, rho(e) of them to other GPUs (routing assumed uniform over experts).
  TP all-reduces bf16 activations of b*T*d: n_tp per layer and step (forward and backward; the count of the
  implementation, see `TP_ALL_REDUCES_PER_LAYER`), one for the embedding and one for the LM head's input gradient,
  each sending 2*rho(t) of its bytes, and all-gathers the logits (b*T*V, bf16).
- time: compute = 3 forward passes (forward + backward) * 2 FLOPs per MAC * the forward MACs of a sequence
  (switchhead.evaluation.accounting.model_forward_macs: the paper's table formula, C=2) * b / t, at `sustained`
  times the bf16 dense peak; communication = bytes sent / link bandwidth, NVLink for a group inside one node
  (8 GPUs), InfiniBand for a group that spans nodes, no overlap, nominal bandwidths (real collectives reach less:
  the communication times are lower bounds). "Overtakes below" is the batch per data-parallel group (sequences)
  below which communication takes longer than compute ("at any batch" where the part growing with the batch, TP's
  and EP's, alone takes longer).

With --check, the shard and payload formulas are evaluated at a benchmark's settings (fp32, its presets, batch and
context) for the layouts it measured and set beside what it counted (the parameter bytes a process holds, the
largest over the processes, and the collectives' payloads). JSON + Markdown go to
benchmarks/results/scaleout_model.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PRESET = "wt103-259m-switchall-xl"
GPUS_PER_NODE = 8
STATE_BYTES = 16  # fp32 master weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
# TP all-reduces of b*T*d activations per decoder layer and step (forward and backward) in SwitchAll-XL's tp_plan:
# counted by benchmarks/bench_scaleout.py under tp_size=2 on the 47M SwitchAll-XL: 130 all-reduces per step for its
# 16 layers (8 per layer, and the embedding's and the LM head input gradient's), whose bytes are those of 7 per layer
# of b*T*d values and 4 values per token and layer more (left out here; see --check and docs/scaling-out.md).
TP_ALL_REDUCES_PER_LAYER = 7
PLANS = {
    8: [dict(dp_replicate_size=8), dict(fsdp_size=8), dict(fsdp_size=8, ep_size=8), dict(fsdp_size=4, tp_size=2),
        dict(fsdp_size=2, tp_size=4)],
    64: [dict(dp_replicate_size=64), dict(fsdp_size=64), dict(dp_replicate_size=8, fsdp_size=8),
         dict(dp_replicate_size=8, fsdp_size=8, ep_size=8), dict(fsdp_size=64, ep_size=32),
         dict(fsdp_size=16, tp_size=4), dict(dp_replicate_size=8, fsdp_size=2, tp_size=4)],
}


def rho(n: int) -> float:
    return (n - 1) / n


def sizes(plan: dict) -> tuple[int, int, int, int]:
    return (plan.get("dp_replicate_size", 1), plan.get("fsdp_size", 1), plan.get("tp_size", 1),
            plan.get("ep_size", 1))


def label(plan: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in plan.items())


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, from the model built on the meta device."""
    from switchhead import SwitchHeadForCausalLM

    with torch.device("meta"):
        model = SwitchHeadForCausalLM(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def is_tail(name: str) -> bool:
    return name.startswith(("model.norm.", "lm_head."))


def tp_replicated(name: str) -> bool:
    return "layernorm" in name or name.startswith("model.norm.") or ".mlp.gate." in name


def parameter_groups(shapes: dict) -> dict[str, int]:
    """Parameter counts by how the plans treat them."""
    groups = dict(total=0, experts=0, tail=0, tp_replicated=0, layer=0)
    for name, shape in shapes.items():
        count = math.prod(shape)
        groups["total"] += count
        groups["experts"] += count * is_expert(name)
        groups["tail"] += count * is_tail(name)
        groups["tp_replicated"] += count * tp_replicated(name)
        groups["layer"] += count * name.startswith("model.layers.0.")
    return groups


def local_shape(name: str, shape: tuple, tp: int, ep: int) -> tuple:
    """A parameter's shape on one GPU after the tp_plan / ep_plan, before FSDP: EP splits the experts (dim 0),
    TP the heads, projections' outputs, vocabulary (dim 0) and the sigma-MoE experts along S."""
    shape = list(shape)
    if ep > 1 and is_expert(name):
        dim, parts = 0, ep
    elif tp > 1 and not tp_replicated(name):
        dim = (2 if name.endswith("expert_keys") else 1 if name.endswith("expert_values") else 0) if is_expert(
            name) else 0
        parts = tp
    else:
        return tuple(shape)
    if shape[dim] % parts:
        raise ValueError(f"{name}: dimension {dim} ({shape[dim]}) does not divide by {parts}")
    shape[dim] //= parts
    return tuple(shape)


def fsdp_padded(shape: tuple, group: int) -> int:
    """Elements FSDP2 all-gathers for a parameter over `group` GPUs: dim 0 padded to a multiple of the group
    (each GPU holds ceil(dim0 / group) rows; a GPU past the last row holds padding)."""
    return math.ceil(shape[0] / group) * group * math.prod(shape[1:])


# ---------------------------------------------------------------------------------------------------- payloads
def fsdp_bytes(params: float, tail: float, group: int, replicas: int, gather_bytes: int,
               reduce_bytes: int) -> dict[str, float]:
    """Sent per GPU by FSDP over `group` GPUs of `params` elements as gathered (padded; of which `tail` gathered
    once), and by its replicas' all-reduce of the gradient shards."""
    gathered = (2 * (params - tail) + tail) * gather_bytes
    out = dict(all_gather=rho(group) * gathered if group > 1 else 0.0,
               reduce_scatter=rho(group) * params * reduce_bytes if group > 1 else 0.0,
               all_reduce=2 * rho(replicas) * params * reduce_bytes / group if replicas > 1 else 0.0)
    out["payload_all_gather"] = gathered if group > 1 else 0.0
    out["payload_all_reduce"] = params * reduce_bytes / group if replicas > 1 else 0.0
    out["payload_reduce_scatter"] = params * reduce_bytes if group > 1 else 0.0
    return out


def fsdp_groups(shapes: dict, plan: dict) -> dict[str, float]:
    """Elements of the FSDP group's parameters as gathered (`dense`, its `tail`) and of the experts' own group under
    EP (`experts`), each padded to its group; `held`, the parameter elements one GPU holds."""
    r, f, t, e = sizes(plan)
    efsdp = f * t // e
    out = dict(dense=0, tail=0, experts=0, held=0)
    for name, shape in shapes.items():
        local = local_shape(name, shape, t, e)
        group = efsdp if e > 1 and is_expert(name) else f
        padded = fsdp_padded(local, group)
        out["experts" if e > 1 and is_expert(name) else "dense"] += padded
        out["tail"] += padded * is_tail(name)
        out["held"] += padded // group
    return out


def step_bytes(shapes: dict, config, plan: dict, batch: int, context: int, activation_bytes: int = 2,
               gather_bytes: int = 2, reduce_bytes: int = 4) -> dict[str, dict]:
    """Bytes one GPU sends per step, by collective group (`fsdp`, `replicas`, `experts_fsdp`, `experts_replicas`,
    `tp`, `ep`), each {"sent": bytes, "group": size, "stride": ranks between members, ...payloads}."""
    r, f, t, e = sizes(plan)
    b = batch / (r * f)
    d, L, k, V = config.hidden_size, config.num_hidden_layers, config.num_mlp_experts_per_tok, config.vocab_size
    elements = fsdp_groups(shapes, plan)
    out = {}
    fs = fsdp_bytes(elements["dense"], elements["tail"], f, r, gather_bytes, reduce_bytes)
    out["fsdp"] = dict(sent=fs["all_gather"] + fs["reduce_scatter"], group=f, stride=t,
                       payload_all_gather=fs["payload_all_gather"], payload_reduce_scatter=fs["payload_reduce_scatter"])
    out["replicas"] = dict(sent=fs["all_reduce"], group=r, stride=f * t, payload_all_reduce=fs["payload_all_reduce"])
    if e > 1:
        efsdp = f * t // e
        ex = fsdp_bytes(elements["experts"], 0, efsdp, r, gather_bytes, reduce_bytes)
        out["experts_fsdp"] = dict(sent=ex["all_gather"] + ex["reduce_scatter"], group=efsdp, stride=e,
                                   payload_all_gather=ex["payload_all_gather"],
                                   payload_reduce_scatter=ex["payload_reduce_scatter"])
        out["experts_replicas"] = dict(sent=ex["all_reduce"], group=r, stride=f * t,
                                       payload_all_reduce=ex["payload_all_reduce"])
        a2a = 4 * L * b * context * k * d * activation_bytes  # dispatch + combine, forward + backward
        out["ep"] = dict(sent=rho(e) * a2a, group=e, stride=1, payload_all_to_all=a2a)
    if t > 1:
        tokens = b * context
        all_reduce = (TP_ALL_REDUCES_PER_LAYER * L + 2) * tokens * d * activation_bytes
        logits = tokens * V * activation_bytes
        out["tp"] = dict(sent=2 * rho(t) * all_reduce + rho(t) * logits, group=t, stride=1,
                         payload_all_reduce=all_reduce, payload_all_gather=logits)
    return out


# ----------------------------------------------------------------------------------------------- memory, time
def spans_nodes(group: int, stride: int, gpus_per_node: int) -> bool:
    return group > 1 and group * stride > gpus_per_node


def plan_row(plan: dict, gpus: int, shapes: dict, config, saved: dict, macs_per_sequence: int, args) -> dict:
    r, f, t, e = sizes(plan)
    assert r * f * t == gpus, plan
    b = args.batch / (r * f)
    groups = parameter_groups(shapes)
    held_params = fsdp_groups(shapes, plan)["held"]
    state = STATE_BYTES * held_params
    in_flight = (2 * 2 * groups["layer"] + 2 * groups["tail"] + (2 + 4) * groups["layer"]) / t
    activations = b * (args.activation_fraction * (
        (saved["attention"] + saved["mlp"]) / t + saved["layernorm"] + saved["rest"]))
    traffic = step_bytes(shapes, config, plan, args.batch, args.context)
    compute_seconds = 3 * 2 * macs_per_sequence * b / t / (args.peak_tflops * 1e12 * args.sustained)
    for part in traffic.values():
        inter = spans_nodes(part["group"], part["stride"], GPUS_PER_NODE)
        part["link"] = "InfiniBand" if inter else ("NVLink" if part["group"] > 1 else "-")
        part["seconds"] = part["sent"] / ((args.ib_gbs if inter else args.nvlink_gbs) * 1e9)
    comm_seconds = sum(part["seconds"] for part in traffic.values())
    # the part that grows with the batch (TP, EP) and the part that does not (parameters): where they cross compute
    per_sequence = sum(part["seconds"] for name, part in traffic.items() if name in ("tp", "ep")) / b
    fixed = comm_seconds - per_sequence * b
    compute_per_sequence = compute_seconds / b
    overtakes = fixed / (compute_per_sequence - per_sequence) if compute_per_sequence > per_sequence else None
    return dict(plan=plan, label=label(plan), gpus=gpus, sequences_per_gpu_group=b, params_held=held_params,
                state_bytes=state, in_flight_bytes=in_flight, activation_bytes=activations,
                total_bytes=state + in_flight + activations, traffic=traffic,
                sent_bytes=sum(part["sent"] for part in traffic.values()), compute_seconds=compute_seconds,
                communication_seconds=comm_seconds, communication_over_compute=comm_seconds / compute_seconds,
                overtakes_below_sequences=overtakes)


def saved_per_sequence(config, context: int) -> dict[str, float]:
    """fp32 bytes autograd saves for one sequence (benchmarks/saved_memory.py), plus the XL memory chunk's extra."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import saved_memory

    from switchhead import SwitchHeadForCausalLM
    from switchhead.evaluation.accounting import attention_memory, default_memory_chunks

    torch.manual_seed(0)
    parts = dict(saved_memory.saved_bytes(SwitchHeadForCausalLM(config), 1, context))
    chunks = default_memory_chunks(config, context)
    extra = (attention_memory(config, context, chunks) - attention_memory(config, context, 0)) * 4
    parts["attention"] += config.num_hidden_layers * extra
    parts["xl_memory_extra"] = config.num_hidden_layers * extra
    return parts


# ------------------------------------------------------------------------------------------------------- check
def check(benchmark: dict) -> list[dict]:
    """The shard and payload formulas at a benchmark's settings (fp32) beside what it counted, layout by layout."""
    from switchhead import SwitchHeadConfig

    rows = []
    for row in benchmark["rows"]:
        if row.get("refused") or not row["layout"]:
            continue
        config = SwitchHeadConfig.from_preset(row["preset"])
        traffic = step_bytes(parameter_shapes(config), config, row["layout"], benchmark["batch"], benchmark["context"],
                             activation_bytes=4, gather_bytes=4, reduce_bytes=4)
        model = dict(all_gather=sum(p.get("payload_all_gather", 0) for p in traffic.values()),
                     reduce_scatter=sum(p.get("payload_reduce_scatter", 0) for p in traffic.values()),
                     all_reduce=sum(p.get("payload_all_reduce", 0) for p in traffic.values()),
                     all_to_all=traffic.get("ep", {}).get("payload_all_to_all", 0))
        model["parameters_held"] = 4 * fsdp_groups(parameter_shapes(config), row["layout"])["held"]
        counted = {kind: row["collectives"][kind]["payload_bytes"] for kind in ("all_gather", "reduce_scatter",
                                                                                "all_reduce", "all_to_all")}
        counted["parameters_held"] = row["held_parts"]["parameters"]  # the largest over the processes
        rows.append(dict(model=row["model"], layout=row["layout_label"], modelled=model, counted=counted))
    return rows


# ------------------------------------------------------------------------------------------------------ output
def markdown(report: dict) -> str:
    a = report["assumptions"]
    gib, mib = 2 ** 30, 2 ** 20
    lines = [f"# A model of training the {report['parameters']['total'] / 1e6:.2f}M SwitchAll on 8 and 64 GPUs",
             "", "Computed by scripts/scaleout_model.py from the assumptions below: a model, not a measurement.", "",
             f"Preset `{a['preset']}` (d={a['hidden_size']}, L={a['layers']}, {a['mlp_experts']} sigma-MoE experts of "
             f"{a['mlp_expert_size']}, k={a['mlp_k']}); global batch {a['batch']} x {a['context']} tokens "
             "(the paper's), "
             f"XL memory of one chunk (C=2); fp32 master weights, gradients and AdamW state (16 bytes per parameter), "
             f"bf16 compute, bf16 parameter all-gathers, fp32 gradient reductions, bf16 activations; "
             f"{a['macs_per_sequence'] / 1e9:.1f} GMAC forward per sequence (paper's table formula), compute at "
             f"{a['sustained']:.0%} of {a['peak_tflops']} TFLOP/s (H100 SXM bf16 dense peak) = "
             f"{a['peak_tflops'] * a['sustained']:.0f} TFLOP/s; links {a['nvlink_gbs']} GB/s per GPU inside a node of "
             f"{a['gpus_per_node']} (NVLink), {a['ib_gbs']} GB/s per GPU between nodes (InfiniBand), nominal, no "
             f"overlap. Activations per sequence: {a['activation_bytes_per_sequence_fp32'] / mib:.0f} MiB in fp32 "
             f"(counted for this implementation on CPU, plus {a['xl_memory_extra_fp32'] / mib:.0f} MiB for the XL "
             "memory chunk by the paper's formula), half of it in bf16.", "",
             "| GPUs | plan | sequences per DP group | state (GiB) | in flight (GiB) | activations (GiB) | "
             "total (GiB) | sent per step (MiB) | compute (ms) | communication (ms) | comm / compute | "
             "communication overtakes below (sequences per DP group) | links |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        links = ", ".join(f"{name} {part['link']}" for name, part in row["traffic"].items() if part["sent"] > 0)
        over = row["overtakes_below_sequences"]
        lines.append(f"| {row['gpus']} | `{row['label']}` | {row['sequences_per_gpu_group']:g} | "
                     f"{row['state_bytes'] / gib:.2f} | {row['in_flight_bytes'] / gib:.2f} | "
                     f"{row['activation_bytes'] / gib:.2f} | {row['total_bytes'] / gib:.2f} | "
                     f"{row['sent_bytes'] / mib:.0f} | {row['compute_seconds'] * 1e3:.1f} | "
                     f"{row['communication_seconds'] * 1e3:.1f} | {row['communication_over_compute']:.2f} | "
                     f"{'at any batch' if over is None else f'{over:.1f}'} | {links or '-'} |")
    if report.get("check"):
        lines += ["", "**The shard and payload formulas against what was counted on CPU** (fp32; MiB per step: "
                  "modelled / "
                  f"counted by benchmarks/bench_scaleout.py on {report['check_machine']})", "",
                  "| model | layout | parameters held | all-gather | reduce-scatter | all-reduce | all-to-all |",
                  "|---|---|---|---|---|---|---|"]
        for row in report["check"]:
            m, c = row["modelled"], row["counted"]
            lines.append(f"| {row['model']} | `{row['layout']}` | {m['parameters_held'] / mib:.2f} / "
                         f"{c['parameters_held'] / mib:.2f} | {m['all_gather'] / mib:.2f} / "
                         f"{c['all_gather'] / mib:.2f} | {m['reduce_scatter'] / mib:.2f} / "
                         f"{c['reduce_scatter'] / mib:.2f} | {m['all_reduce'] / mib:.2f} / "
                         f"{c['all_reduce'] / mib:.2f} | {m['all_to_all'] / mib:.2f} / {c['all_to_all'] / mib:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--batch", type=int, default=64, help="global batch, sequences (the paper's: 64)")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="bf16 dense peak (H100 SXM: 989.4)")
    parser.add_argument("--sustained", type=float, default=0.4, help="fraction of the peak sustained")
    parser.add_argument("--nvlink-gbs", type=float, default=450.0, help="GB/s per GPU per direction, in a node")
    parser.add_argument("--ib-gbs", type=float, default=50.0, help="GB/s per GPU per direction, between nodes")
    parser.add_argument("--activation-fraction", type=float, default=0.5,
                        help="bf16 activations against the fp32 count (0.5: every saved tensor in bf16)")
    parser.add_argument("--check", type=Path, default=None, help="a bench_scaleout.py JSON to set beside")
    parser.add_argument("--out", type=Path, default=RESULTS / "scaleout_model.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from switchhead import SwitchHeadConfig
    from switchhead.evaluation.accounting import model_forward_macs

    config = SwitchHeadConfig.from_preset(args.preset)
    args.context = args.context or config.max_position_embeddings
    shapes = parameter_shapes(config)
    groups = parameter_groups(shapes)
    macs = model_forward_macs(config, args.context)["total"]
    saved = saved_per_sequence(config, args.context)
    rows = [plan_row(plan, gpus, shapes, config, saved, macs, args) for gpus, plans in PLANS.items()
            for plan in plans]
    assumptions = dict(preset=args.preset, hidden_size=config.hidden_size, layers=config.num_hidden_layers,
                       mlp_experts=config.num_mlp_experts, mlp_expert_size=config.mlp_expert_size,
                       mlp_k=config.num_mlp_experts_per_tok, batch=args.batch, context=args.context,
                       macs_per_sequence=macs, peak_tflops=args.peak_tflops, sustained=args.sustained,
                       nvlink_gbs=args.nvlink_gbs, ib_gbs=args.ib_gbs, gpus_per_node=GPUS_PER_NODE,
                       state_bytes_per_parameter=STATE_BYTES, activation_fraction=args.activation_fraction,
                       activation_bytes_per_sequence_fp32=sum(v for k, v in saved.items() if k != "xl_memory_extra"),
                       xl_memory_extra_fp32=saved["xl_memory_extra"], saved_fp32_by_part=saved,
                       tp_all_reduces_per_layer=TP_ALL_REDUCES_PER_LAYER)
    report = dict(kind="model (computed from the assumptions; not a measurement)", assumptions=assumptions,
                  parameters=groups, rows=rows)
    if args.check:
        benchmark = json.loads(args.check.read_text())
        report["check"] = check(benchmark)
        report["check_machine"] = benchmark["machine"]["device"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
