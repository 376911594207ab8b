"""The "Scaling out" table of docs/scaling-out.md: each layout of Transformers' distributed engine against one process.

    python scripts/scaleout_table.py [--steps 3] [--out table.md]

For each tiny preset (dropout off) and each layout on 2 or 4 gloo processes (`torchrun`, CPU), the training run of
tests/training/scaleout_worker.py (SGD with momentum, the sigma-MoE entropy regulariser on) is compared with the
one-process reference on the same data: the largest relative difference of a step's loss and the largest absolute
difference of a final weight; a layout refused at load (or at the first training step) shows its reason. Prints a
Markdown table (and writes it with --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parents[1] / "tests" / "training" / "scaleout_worker.py"
PRESETS = {"SwitchAll": "tiny-switchall", "SwitchHead-XL": "tiny-switchhead-xl", "SwitchHead (RoPE)": "tiny-switchhead"}
LAYOUTS = [{"tp_size": 2}, {"fsdp_size": 2}, {"pp_size": 2}, {"fsdp_size": 2, "ep_size": 2},
           {"tp_size": 2, "ep_size": 2}, {"tp_size": 2, "fsdp_size": 2}, {"dp_replicate_size": 2, "fsdp_size": 2}]
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "mlp_expert_dropout": 0.0,
              "attention_expert_dropout": 0.0}


def processes(layout: dict) -> int:
    """Processes a layout runs on: tp x fsdp x dp_replicate x pp (ep divides the FSDP processes); at least 2."""
    return max(math.prod(layout.get(size, 1) for size in ("tp_size", "fsdp_size", "dp_replicate_size", "pp_size")), 2)


def data_parallel_shares(layout: dict) -> int:
    return layout.get("fsdp_size", 1) * layout.get("dp_replicate_size", 1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(model: Path, out: Path, layout: dict, steps: int, data_parallel: int = 1) -> str | None:
    """The worker's run; None when it finished, else the last error line it printed."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [str(WORKER), str(model), str(out), "--layout", json.dumps(layout), "--steps", str(steps),
               "--data-parallel", str(data_parallel)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes(layout)),
                "--master_port", str(free_port())] if layout else [sys.executable]
    done = subprocess.run(launcher + command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 0:
        return None
    errors = [line for line in done.stderr.splitlines() if "Error: " in line and "ChildFailedError" not in line]
    return errors[-1].split("Error: ", 1)[1] if errors else done.stderr[-300:]


def compare(out: Path, reference: Path) -> tuple[float, float]:
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    expected = json.loads((reference / "rank0.json").read_text())["losses"]
    loss = max(abs(got - expected[step][part]) / abs(expected[step][part])
               for rank in ranks for step, losses in enumerate(rank["losses"])
               for got, part in zip(losses, rank["parts"], strict=True))
    weights, reference_weights = torch.load(out / "weights.pt"), torch.load(reference / "weights.pt")
    weight = max((weights[name] - reference_weights[name]).abs().max().item() for name in reference_weights)
    return loss, weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    rows = {json.dumps(layout): [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for name, preset in PRESETS.items():
            torch.manual_seed(0)
            model = work / preset
            SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset, **NO_DROPOUT)).save_pretrained(model)
            references = {}
            for data_parallel in sorted({data_parallel_shares(layout) for layout in LAYOUTS}):
                references[data_parallel] = work / f"{preset}-reference-{data_parallel}"
                failed = run(model, references[data_parallel], {}, args.steps, data_parallel)
                assert failed is None, failed
            for layout in LAYOUTS:
                out = work / f"{preset}-{'-'.join(f'{k}{v}' for k, v in layout.items())}"
                failed = run(model, out, layout, args.steps)
                if failed is not None:
                    cell = f"refused: {failed}"
                else:
                    loss, weight = compare(out, references[data_parallel_shares(layout)])
                    cell = f"loss {loss:.1e}, weights {weight:.1e}"
                rows[json.dumps(layout)].append(cell)
                print(f"{name} {layout}: {cell}", flush=True)
    lines = ["| layout | processes | " + " | ".join(PRESETS) + " |", "|---" * (len(PRESETS) + 2) + "|"]
    for layout, cells in rows.items():
        sizes = ", ".join(f"`{k}={v}`" for k, v in json.loads(layout).items())
        lines.append(f"| {sizes} | {processes(json.loads(layout))} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
