"""Training past one process on CPU: per-process memory, step time and bytes communicated under the plans of
Transformers' distributed engine.

    python benchmarks/bench_scaleout.py [--models SwitchAll,SwitchHead-XL] [--steps 3] [--batch 4] [--context 128]
    python benchmarks/bench_scaleout.py --quick      # tiny-switchall, one process and fsdp_size=2 + ep_size=2

For each model (the 47M SwitchAll preset; with --models also SwitchHead-XL's; dropout off, fp32) and each layout
(`MODELS`: one process; fsdp 2, tp 2, fsdp 2 + ep 2 on 2 processes; fsdp 4, fsdp 4 + ep 4, fsdp 2 + tp 2, and
dp_replicate 2 x fsdp 2 (HSDP) on 4), a saved folder is loaded with `from_pretrained(...,
distributed_config=DistributedConfig(...))` under `torchrun` (gloo, CPU, one thread per process), or alone for the
one-process row, and trained with AdamW: one warm-up step, `--steps` timed steps, then one step whose collectives
are counted. The global batch is the same in every row (`--batch` sequences of `--context` tokens): each
data-parallel group (`dp_replicate_size * fsdp_size` of them) takes an equal share of it, and the processes of a
tensor-parallel group share theirs. Each process reports:

- peak resident memory (VmHWM of /proc/self/status) while loading, and during training (after loading, the heap it
  freed is handed back with malloc_trim and the high-water mark reset through /proc/self/clear_refs, so the second
  figure is that of the training steps, on top of what the loaded process holds);
- the bytes of parameters, gradients and AdamW state it holds after a step (its local shards, fp32);
- the median time of a step (forward, backward, optimizer step, zero_grad; the processes start each step together
  after a barrier);
- the collectives of one step, counted at the dispatcher (a TorchDispatchMode that sees every `c10d` and
  `_c10d_functional` op the process issues, DTensor's included): for each kind, the payload (the whole tensor an
  all-gather produces, a reduce-scatter or all-reduce reduces, an all-to-all sends from this process) and the bytes
  this process sends under ring algorithms ((n-1)/n of the payload for an all-gather or reduce-scatter of a group of
  n, 2(n-1)/n for an all-reduce, all but its own split for an all-to-all). What gloo's own algorithms put on the wire
  is not observed.

With more processes than cores, step times measure time-sharing of the cores, not scaling; memory and bytes
communicated do not depend on it. JSON + Markdown go to benchmarks/results/scaleout_cpu_<cpu>.{json,md}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, file_slug, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "mlp_expert_dropout": 0.0,
              "attention_expert_dropout": 0.0}
# model label -> (preset, layouts); {} is one process
MODELS = {
    "SwitchAll": ("wt103-47m-switchall-xl", [{}, {"fsdp_size": 2}, {"tp_size": 2}, {"fsdp_size": 2, "ep_size": 2},
                                             {"fsdp_size": 4}, {"fsdp_size": 4, "ep_size": 4},
                                             {"fsdp_size": 2, "tp_size": 2},
                                             {"dp_replicate_size": 2, "fsdp_size": 2}]),
    "SwitchHead-XL": ("wt103-47m-switchhead-xl", [{}, {"fsdp_size": 2}, {"tp_size": 2}, {"fsdp_size": 4}]),
}
QUICK_MODELS = {"SwitchAll": ("tiny-switchall", [{}, {"fsdp_size": 2, "ep_size": 2}])}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def processes(layout: dict) -> int:
    """The processes a layout needs: Transformers' mesh is pp x dp_replicate x fsdp x tp (ep lies inside it)."""
    return math.prod(layout.get(axis, 1) for axis in ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size"))


def label(layout: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in layout.items()) or "one process"


# ------------------------------------------------------------------------------------------ counting collectives
def _bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(tensor) for tensor in tensors)


def _group(group):
    """A process group from a c10d op's argument (a boxed ProcessGroup), or a functional collective's group name."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    if isinstance(group, torch.ScriptObject):
        return torch.distributed.ProcessGroup.unbox(group)
    return group


# op name -> (kind, payload bytes, group, this process's own split of an all-to-all's input, in bytes)
def _all_to_all(tensor, splits, group):
    group = _group(group)
    own = (tensor.shape[0] and splits[group.rank()] * _bytes(tensor) // tensor.shape[0]) if splits else (
        _bytes(tensor) // group.size())
    return "all_to_all", _bytes(tensor), group, own


COLLECTIVES = {
    "c10d::_allgather_base_": lambda a: ("all_gather", _bytes(a[0]), a[2], 0),
    "c10d::allgather_": lambda a: ("all_gather", _bytes(a[0]), a[2], 0),
    "c10d::allgather_into_tensor_coalesced_": lambda a: ("all_gather", _bytes(a[0]), a[2], 0),
    "c10d::_reduce_scatter_base_": lambda a: ("reduce_scatter", _bytes(a[1]), a[2], 0),
    "c10d::reduce_scatter_": lambda a: ("reduce_scatter", _bytes(a[1]), a[2], 0),
    "c10d::reduce_scatter_tensor_coalesced_": lambda a: ("reduce_scatter", _bytes(a[1]), a[2], 0),
    "c10d::allreduce_": lambda a: ("all_reduce", _bytes(a[0]), a[1], 0),
    "c10d::allreduce_coalesced_": lambda a: ("all_reduce", _bytes(a[0]), a[1], 0),
    "c10d::alltoall_base_": lambda a: _all_to_all(a[1], a[4], a[2]),
    "c10d::broadcast_": lambda a: ("broadcast", _bytes(a[0]), a[1], 0),
    "_c10d_functional::all_reduce": lambda a: ("all_reduce", _bytes(a[0]), a[2], 0),
    "_c10d_functional::all_reduce_coalesced": lambda a: ("all_reduce", _bytes(a[0]), a[2], 0),
    "_c10d_functional::all_gather_into_tensor": lambda a: ("all_gather", _bytes(a[0]) * a[1], a[2], 0),
    "_c10d_functional::all_gather_into_tensor_coalesced": lambda a: ("all_gather", _bytes(a[0]) * a[1], a[2], 0),
    "_c10d_functional::reduce_scatter_tensor": lambda a: ("reduce_scatter", _bytes(a[0]), a[3], 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": lambda a: ("reduce_scatter", _bytes(a[0]), a[3], 0),
    "_c10d_functional::all_to_all_single": lambda a: _all_to_all(a[0], a[2], a[3]),
    "_c10d_functional::broadcast": lambda a: ("broadcast", _bytes(a[0]), a[2], 0),
    "_c10d_functional_autograd::all_to_all_single": lambda a: _all_to_all(a[0], a[2], a[3]),
    "_c10d_functional_autograd::all_gather_into_tensor": lambda a: ("all_gather", _bytes(a[0]) * a[1], a[2], 0),
    "_c10d_functional_autograd::reduce_scatter_tensor": lambda a: ("reduce_scatter", _bytes(a[0]), a[3], 0),
}
NOT_COMMUNICATION = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::barrier",
                     "c10d::monitored_barrier_"}


def sent_bytes(kind: str, payload: int, size: int, own: int) -> float:
    """Bytes one process of a group of `size` sends for a collective of `payload` bytes, under ring algorithms."""
    if kind in ("all_gather", "reduce_scatter"):
        return payload * (size - 1) / size
    if kind == "all_reduce":
        return 2 * payload * (size - 1) / size
    if kind == "all_to_all":
        return payload - own
    return payload  # broadcast: each process but the last of a pipelined ring forwards the whole tensor


def collective_counter():
    """A TorchDispatchMode whose `.kinds` sums, per kind of collective, its count, payload and bytes sent."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kinds = {kind: dict(count=0, payload_bytes=0, sent_bytes=0.0) for kind in KINDS}
            self.unaccounted: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed.tensor import DTensor

            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor desugars the op into plain ops and collectives, which come back here
            name = func._schema.name
            if name in COLLECTIVES:
                kind, payload, group, own = COLLECTIVES[name](list(args))
                size = _group(group).size()
                if size > 1:
                    entry = self.kinds[kind]
                    entry["count"] += 1
                    entry["payload_bytes"] += payload
                    entry["sent_bytes"] += sent_bytes(kind, payload, size, own)
            elif name.split("::")[0] in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and (
                    name not in NOT_COMMUNICATION):
                self.unaccounted[name] = self.unaccounted.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return CollectiveCounter()


# ------------------------------------------------------------------------------------------------- one process
def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    return _bytes(tensor.to_local() if isinstance(tensor, DTensor) else tensor)


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of this process's parameters, gradients and optimizer state (its shards, not the whole tensors)."""
    parameters = list(model.parameters())
    state = [value for per_parameter in optimizer.state.values() for value in per_parameter.values()
             if isinstance(value, torch.Tensor)]
    return dict(parameters=sum(_local_bytes(p) for p in parameters),
                gradients=sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
                optimizer=sum(_local_bytes(value) for value in state))


def worker(model_folder: str, out: str, layout: dict, batch: int, context: int, steps: int) -> None:
    """One process of a layout (or the one-process run): writes OUT/rank{R}.json."""
    import torch.distributed as dist

    from switchhead import SwitchHeadForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    if layout:
        from transformers import DistributedConfig

        model = SwitchHeadForCausalLM.from_pretrained(model_folder, distributed_config=DistributedConfig(**layout))
        rank, tp = dist.get_rank(), layout.get("tp_size", 1)
        fsdp = layout.get("dp_replicate_size", 1) * layout.get("fsdp_size", 1)  # the data-parallel groups
        share = (rank // tp) % fsdp  # Transformers' mesh puts tp innermost: a tensor-parallel group shares a batch
    else:
        model = SwitchHeadForCausalLM.from_pretrained(model_folder)
        rank, fsdp, share = 0, 1, 0
    load_seconds = time.perf_counter() - start
    load_peak = _status_kib("VmHWM")
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back the heap that loading freed, so it is not counted below
    after_load = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the training peak below is that of the steps
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    rows = batch // fsdp
    vocab = model.config.vocab_size

    def step(index: int) -> float:
        ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(index))
        ids = ids[share * rows:(share + 1) * rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    times, losses = [], []
    for index in range(1 + steps):  # the first is a warm-up
        if layout:
            dist.barrier()
        begin = time.perf_counter()
        losses.append(step(index))
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - begin)
    if layout:
        dist.barrier()
    counter = collective_counter()
    with counter:
        losses.append(step(1 + steps))
    held = held_bytes(model, optimizer)  # gradients still there: zero_grad comes after
    optimizer.zero_grad(set_to_none=True)
    result = dict(rank=rank, load_seconds=load_seconds, load_peak_rss_bytes=load_peak * 1024,
                  rss_after_load_bytes=after_load * 1024, train_peak_rss_bytes=_status_kib("VmHWM") * 1024,
                  held_bytes=held, step_seconds=times[1:], median_step_seconds=statistics.median(times[1:]),
                  losses=losses, collectives=counter.kinds, unaccounted_collectives=counter.unaccounted,
                  rows_per_process=rows)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    if layout:
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- driver
def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_layout(model: Path, out: Path, layout: dict, args) -> tuple[list[dict] | None, str | None]:
    """The layout's processes: their results, or None and the last error line they printed."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [str(Path(__file__).resolve()), "--worker", str(model), str(out), "--layout", json.dumps(layout),
               "--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes(layout)),
                "--master_port", str(free_port())] if layout else [sys.executable]
    done = subprocess.run(launcher + command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error: " in line and "ChildFailedError" not in line]
        return None, (errors[-1].split("Error: ", 1)[1] if errors else done.stderr[-300:])
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))], None


def summarise(ranks: list[dict]) -> dict:
    """One row: the largest figure over the processes (the step waits for the slowest; memory per process)."""
    held = max(sum(rank["held_bytes"].values()) for rank in ranks)
    kinds = {kind: dict(count=max(r["collectives"][kind]["count"] for r in ranks),
                        payload_bytes=max(r["collectives"][kind]["payload_bytes"] for r in ranks),
                        sent_bytes=max(r["collectives"][kind]["sent_bytes"] for r in ranks)) for kind in KINDS}
    return dict(processes=len(ranks), held_bytes=held, ranks=ranks,
                held_parts={part: max(r["held_bytes"][part] for r in ranks) for part in ranks[0]["held_bytes"]},
                load_peak_rss_bytes=max(r["load_peak_rss_bytes"] for r in ranks),
                rss_after_load_bytes=max(r["rss_after_load_bytes"] for r in ranks),
                train_rise_bytes=max(r["train_peak_rss_bytes"] - r["rss_after_load_bytes"] for r in ranks),
                train_peak_rss_bytes=max(r["train_peak_rss_bytes"] for r in ranks),
                median_step_seconds=max(r["median_step_seconds"] for r in ranks),
                sent_bytes=max(sum(r["collectives"][k]["sent_bytes"] for k in KINDS) for r in ranks),
                collectives=kinds, unaccounted_collectives={k: v for r in ranks
                                                            for k, v in r["unaccounted_collectives"].items()})


def markdown(report: dict) -> str:
    machine = report["machine"]
    mib = 2 ** 20
    lines = ["# Scaling out on one machine: memory, step time and bytes communicated per process", "",
             f"Measured on {machine['device']} ({report['cores']} cores, host `{machine['machine']}`), torch "
             f"{machine['torch']}, Transformers {machine['transformers']}, gloo, one thread per process, fp32, "
             f"AdamW; global batch {report['batch']} x {report['context']} tokens in every row, "
             f"{report['steps']} timed steps after one warm-up; load average "
             f"{report['load_average_before'][0]:.1f} before, {report['load_average_after'][0]:.1f} after. "
             "Each figure is the largest over the processes of a row.", ""]
    if report["oversubscribed"]:
        lines += [f"**{report['cores']} cores:** rows with more processes than cores time-share them; their step "
                  "times measure that, not scaling. Memory and bytes communicated do not depend on it.", ""]
    lines += ["| model | layout | processes | params + grads + AdamW held (MiB) | RSS after loading (MiB) | "
              "peak RSS, training (MiB) | its rise over loading (MiB) | peak RSS, loading (MiB) | median step (s) | "
              "sent per step (MiB) | all-gather / reduce-scatter / all-reduce / all-to-all payload (MiB) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if row.get("refused"):
            lines.append(f"| {row['model']} | `{row['layout_label']}` | {row['processes']} | refused: "
                         f"{row['refused'][:160]} | | | | | | | |")
            continue
        payload = " / ".join(f"{row['collectives'][k]['payload_bytes'] / mib:.1f}"
                             for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))
        lines.append(f"| {row['model']} | `{row['layout_label']}` | {row['processes']} | "
                     f"{row['held_bytes'] / mib:.0f} | {row['rss_after_load_bytes'] / mib:.0f} | "
                     f"{row['train_peak_rss_bytes'] / mib:.0f} | {row['train_rise_bytes'] / mib:.0f} | "
                     f"{row['load_peak_rss_bytes'] / mib:.0f} | {row['median_step_seconds']:.2f} | "
                     f"{row['sent_bytes'] / mib:.1f} | {payload} |")
    lines += ["", "Held: the tensors of the process's parameter, gradient and AdamW shards after a step. Resident "
              "memory is the process's whole (torch, gloo, the allocator's cache): after loading, the freed heap "
              "handed back (malloc_trim); the training peak's rise over it is what the steps added (activations, "
              "gathered parameters, gradients, AdamW state, communication buffers). "
              "Sent per step: bytes one process sends in one training step under ring algorithms, from the "
              "collectives counted at the dispatcher (not gloo's wire traffic). Payload: the whole tensor an "
              "all-gather produces or a reduce-scatter / all-reduce reduces, and what an all-to-all sends from "
              "this process, summed over the step. Models: "
              + "; ".join(f"{name} = `{preset}` ({report['parameters'][name] / 1e6:.2f}M parameters)"
                          for name, preset in report["presets"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--batch", type=int, default=4, help="global batch: sequences per step")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--models", default="SwitchAll", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--quick", action="store_true", help="tiny-switchall, one process and fsdp 2 + ep 2 (smoke)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one layout's run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, json.loads(args.layout), args.batch, args.context, args.steps)
        return 0
    if args.steps < 1 or args.context < 1:
        parser.error("--steps and --context must be at least 1")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; of {', '.join(MODELS)}")
    models = QUICK_MODELS if args.quick else {name: MODELS[name] for name in args.models.split(",")}
    for name, (_, layouts) in models.items():
        for layout in layouts:
            if args.batch % (layout.get("dp_replicate_size", 1) * layout.get("fsdp_size", 1)):
                parser.error(f"--batch ({args.batch}) must divide by every dp_replicate_size * fsdp_size "
                             f"({label(layout)})")
    torch.set_num_threads(1)
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    load_before = os.getloadavg()
    rows, parameters = [], {}
    with tempfile.TemporaryDirectory() as work:
        for name, (preset, layouts) in models.items():
            torch.manual_seed(0)
            folder = Path(work) / preset
            model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset, **NO_DROPOUT))
            parameters[name] = sum(p.numel() for p in model.parameters())
            model.save_pretrained(folder)
            del model
            for layout in layouts:
                ranks, refused = run_layout(folder, Path(work) / f"{preset}-{len(rows)}", layout, args)
                row = dict(model=name, preset=preset, layout=layout, layout_label=label(layout),
                           processes=processes(layout))
                row.update(summarise(ranks) if ranks else dict(refused=refused))
                rows.append(row)
                print(f"{name} {label(layout)}: " + (f"refused: {refused}" if refused else
                      f"held {row['held_bytes'] / 2**20:.0f} MiB, peak {row['train_peak_rss_bytes'] / 2**20:.0f} "
                      f"MiB, step {row['median_step_seconds']:.2f} s, sent {row['sent_bytes'] / 2**20:.1f} MiB"),
                      flush=True)
    cores = os.cpu_count()
    report = dict(machine=describe(torch.device("cpu")), cores=cores, batch=args.batch, context=args.context,
                  steps=args.steps, quick=args.quick, presets={name: preset for name, (preset, _) in models.items()},
                  parameters=parameters, load_average_before=load_before, load_average_after=os.getloadavg(),
                  oversubscribed=any(row["processes"] > cores for row in rows),
                  note="step times of rows with more processes than cores measure time-sharing of the cores",
                  rows=rows)
    save_results(args.out or RESULTS / f"scaleout_cpu_{file_slug(report['machine']['device'])}.json", report,
                 markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
