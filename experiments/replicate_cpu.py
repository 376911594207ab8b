"""Do the experts matter? The `cpu`-scale replication, as one resumable background grid.

SwitchHead (RoPE, H=2, E=5, k=2, dh=32) against the parameter-matched dense baselines and the gated dense control
(the same-total-heads dense model with SwitchHead's per-head sigmoid output gate), d=192, 6 layers, about 5M
parameters, on WikiText-2 with one 8k BPE tokenizer. The runs themselves are `replicate.run_one` (train with
`switchhead.training.train`, then sliding-window perplexity on the first half of WikiText-2 valid and all of test);
this script adds the grid's order, the learning-rate choice, the records and the results pages.

Order (most important answer first, so that a grid cut off anywhere has answered the most it could):

    1. lr sweep, seed 0: SwitchHead, same-total-heads dense, gated control at each of LEARNING_RATES (the previous
       best, 8e-3, in the middle). A model whose best lr is at an edge of its sweep gets the next lr beyond that
       edge (x2 or /2, up to MAX_EXTENSIONS), so that every chosen lr is bracketed.
    2. seeds 1 and 2 of the three at their own best lr (seed 0 is the sweep's run at that lr).
    3. the same-active-heads dense baseline, seed 0, at the same-total-heads baseline's best lr (no own sweep).
    4. at SwitchHead's best lr, seed 0: E=2 and E=8 at k=2 (E=5 is SwitchHead itself, E=1 is the gated control),
       value-only and output-only experts.
    5. the XL pair: SwitchHead, same-total-heads dense and gated control with Transformer-XL positions, seed 0, each
       at its RoPE best lr.

Resumable: every run is a child process in its own folder under --out; a run whose `grid_record.json` exists is
finished and never run again; an interrupted run resumes from its newest checkpoint (model, optimizer, RNG states,
data position: the trainer's exact resume, checkpoints every `save_every` steps). After every finished run the
results pages are rewritten from all finished runs.

    # start or resume the grid in the background (one core, lowest priority, outlives the shell); when every run
    # has finished it goes on with the zero-shot step (--then-zero-shot)
    experiments/run_cpu_grid.sh
    # pause / resume it (the driver writes its process-group id to the pgid file in the run folder)
    kill -STOP -$(cat runs/replication-cpu/grid.pgid); kill -CONT -$(cat runs/replication-cpu/grid.pgid)
    python experiments/replicate_cpu.py --list           # the grid as far as it is decided now
    python experiments/replicate_cpu.py --report-only    # rewrite the results pages from the run folders
    python experiments/replicate_cpu.py --zero-shot      # BLiMP / LAMBADA of the 3-seed models (after the grid)

Results: benchmarks/results/replication_cpu.{json,md} and replication_cpu_<comparison>.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replicate  # noqa: E402  (the small grid's run machinery, shared)

REPO = replicate.REPO
RESULTS_DIR = replicate.RESULTS_DIR
STEM = "replication_cpu"
FINISHED = "grid_record.json"  # written last by a run's child: its presence means the run is finished
LEGEND_WIDTH = 110  # characters of a legend line in the plots (longer labels wrap)
MAX_ATTEMPTS = 3  # a run whose child failed this often is left out (and listed as failed)

# the planned cpu shapes; the tokens per run are cut to keep the grid near 5 CPU-hours (see STEPS_NOTE)
STEPS = 240
STEPS_NOTE = (
    "runs shortened from the planned 1,200 steps (4.9M tokens, 1.7 epochs) to 240 steps (0.98M tokens, 0.35 epoch of "
    "the 2.84M-token training split), every model alike, to keep the grid near 5 CPU-hours: measured before the grid "
    "on a 2-core machine (shared, load average 3-4) with 1 torch thread, a training step of 16 x 256 tokens took "
    "3.3-5 s wall (820-1,190 tokens/s) and about 2.5 CPU-s (~1,600 tokens per CPU-second); a forward pass ran at "
    "3,100-3,900 tokens/s, so the sliding-window evaluation (first half of valid + all of test, ~1M scored-window "
    "tokens) costs about 5 CPU-minutes per run. 240 steps make a run about 15 CPU-minutes, the 20 runs before the XL "
    "pair about 5 h; the XL pair comes last and runs if the grid is left to finish")
SCALE = dataclasses.replace(
    replicate.SCALES["cpu"], max_steps=STEPS, warmup_steps=20, eval_every=48, eval_batches=6, save_every=60, seeds=3,
    valid_fraction=0.5, about=f"d=192, 6 layers, ~5.8M parameters (3.1M of them embeddings/output), T=256, {STEPS} "
    f"steps x 16 x 256 = {STEPS * 16 * 256 / 1e6:.2f}M tokens")
LEARNING_RATES = (8e-3, 4e-3, 1.6e-2)  # the small grid's best (8e-3) first, then one factor of 2 either side
MAX_EXTENSIONS = 2


def use_tiny() -> None:
    """Tiny models and a short run for the tests (seconds per run); passed on to every child with --tiny."""
    global SCALE, LEARNING_RATES
    SCALE = dataclasses.replace(replicate.SCALES["smoke"], max_steps=60, warmup_steps=2, save_every=10,
                                eval_every=20, eval_batches=1, seeds=3, hidden_dropout=0.1, about="tiny (tests)")
    LEARNING_RATES = (2e-3, 1e-3, 4e-3)


MAIN_ROLES = ("switchhead", "dense-total", "gate")


def write_json(path: Path, value) -> None:
    """Atomically (a kill mid-write leaves the old file or none, never half of one)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(value, indent=1))
    os.replace(temporary, path)


def lr_tag(lr: float) -> str:
    return f"lr{lr:g}"  # lr0.008


# ================================================================================================ the grid
def model_spec(role: str, lr: float, seed: int, position: str = "rope") -> replicate.RunSpec:
    """One run: a model (role), its learning rate, its seed."""
    s = SCALE
    active_dh = s.dense_heads * s.dense_head_dim // s.heads
    models = {
        "switchhead": (f"SwitchHead H={s.heads} E={s.experts} k={s.k} dh={s.head_dim}",
                       replicate.switchhead_fields(s, position), False),
        "dense-total": (f"dense H={s.dense_heads} dh={s.dense_head_dim} (same total heads)",
                        replicate.dense_fields(s, position, s.dense_heads, s.dense_head_dim), True),
        "gate": (f"dense H={s.dense_heads} dh={s.dense_head_dim} + output gate (gated control)",
                 replicate.dense_fields(s, position, s.dense_heads, s.dense_head_dim, gate=True), True),
        "dense-active": (f"dense H={s.heads} dh={active_dh} (same active heads)",
                         replicate.dense_fields(s, position, s.heads, active_dh), True),
        "E2": ("SwitchHead E=2 k=2", replicate.switchhead_fields(s, position, 2, 2), True),
        "E8": ("SwitchHead E=8 k=2", replicate.switchhead_fields(s, position, 8, 2), True),
        "Vonly": ("SwitchHead value experts only (dense O)",
                  replicate.switchhead_fields(s, position, s.experts, s.k, sides="value"), True),
        "Oonly": ("SwitchHead output experts only (dense V)",
                  replicate.switchhead_fields(s, position, s.experts, s.k, sides="output"), True),
    }
    label, fields, match = models[role]
    prefix = "" if position == "rope" else f"{position}-"
    label = f"{label}, {'RoPE' if position == 'rope' else position.upper()}"
    return replicate.RunSpec(name=f"{prefix}{lr_tag(lr)}-{role}-s{seed}", model=f"{prefix}{lr_tag(lr)}-{role}",
                             comparison=position, role=role, label=f"{label}, lr {lr:g}", seed=seed, fields=fields,
                             match=match, training={"learning_rate": lr})


def finished_records(out: Path, results_dir: Path | None = None) -> dict[str, dict]:
    """The finished runs' records: those of `results_dir`'s committed results page (runs an earlier machine
    finished: a fresh checkout has no run folders, and a run recorded there is never run again) when it was written
    at this scale, then those of the run folders under `out`, which take precedence."""
    records = {}
    committed = results_dir / f"{STEM}.json" if results_dir is not None else None
    if committed is not None and committed.is_file():
        page = json.loads(committed.read_text())
        if page.get("scale") == json.loads(json.dumps(dataclasses.asdict(SCALE))):  # as the page stores it
            records.update(page.get("runs", {}))
    for path in sorted(out.glob(f"*/{FINISHED}")):
        record = replicate.portable_paths(json.loads(path.read_text()), out)
        records[record["name"]] = record
    return records


def sweep_of(role: str, records: dict[str, dict]) -> tuple[list[float], float | None]:
    """(the lrs of `role`'s seed-0 sweep as far as decided now, its best lr or None while undecided).

    Best = lowest validation perplexity (sliding window, first half of the split). When the best is at an edge,
    the sweep grows by the next lr beyond it (at most MAX_EXTENSIONS times); the best is decided once every lr of
    the sweep has finished and the best is bracketed or the extensions are used up."""
    lrs = list(LEARNING_RATES)
    for _ in range(MAX_EXTENSIONS + 1):
        valid = {}
        for lr in lrs:
            record = records.get(model_spec(role, lr, 0).name)
            if record is None:
                return lrs, None
            valid[lr] = record["perplexity"]["valid"]["perplexity"]
        best = min(valid, key=valid.get)
        if len(lrs) - len(LEARNING_RATES) >= MAX_EXTENSIONS or min(lrs) < best < max(lrs):
            return lrs, best
        lrs.append(best * 2 if best == max(lrs) else best / 2)
    return lrs, best


def plan(records: dict[str, dict]) -> tuple[list[replicate.RunSpec], list[str]]:
    """(the runs decided so far, in order; what is not yet decided and why)."""
    runs: list[replicate.RunSpec] = []
    undecided: list[str] = []
    best: dict[str, float] = {}
    for lr in LEARNING_RATES:  # stage 1: interleaved, so every lr has all three models before the next lr
        runs += [model_spec(role, lr, 0) for role in MAIN_ROLES]
    for role in MAIN_ROLES:
        lrs, chosen = sweep_of(role, records)
        runs += [model_spec(role, lr, 0) for lr in lrs if lr not in LEARNING_RATES]
        if chosen is None:
            undecided.append(f"{role}: best lr (its sweep is not finished)")
        else:
            best[role] = chosen
    for seed in range(1, SCALE.seeds):  # stage 2
        runs += [model_spec(role, best[role], seed) for role in MAIN_ROLES if role in best]
    if "dense-total" in best:  # stage 3
        runs.append(model_spec("dense-active", best["dense-total"], 0))
    if "switchhead" in best:  # stage 4
        runs += [model_spec(role, best["switchhead"], 0) for role in ("E2", "E8", "Vonly", "Oonly")]
    runs += [model_spec(role, best[role], 0, "xl") for role in MAIN_ROLES if role in best]  # stage 5
    if undecided:
        undecided.append("every later run that uses that lr")
    return runs, undecided


# ================================================================================================ provenance
def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    # uncommitted changes and new files: "XY path" lines (not stripped: X is a space for a change not yet staged)
    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    return dict(commit=git("rev-parse", "HEAD").strip(), dirty=changed,
                at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def changes_to_code(dirty: list[str]) -> list[str]:
    """The changed paths of a `git_state` that are not the grid's own results pages (benchmarks/results/
    replication_cpu*, which the grid rewrites after every run in the checkout it runs from). Records written before
    `git_state` kept the porcelain's leading space lost the first path's first letter: matched by name, they count
    as results pages too."""
    return [path for path in dirty
            if not (Path(path).parent.name == "results" and Path(path).name.startswith("replication_cpu"))]


# ================================================================================================ one run (child)
def run_child(name: str, out: Path, data: str, threads: int) -> int:
    import torch

    torch.set_num_threads(threads)
    spec = replicate.RunSpec(**json.loads((out / "specs" / f"{name}.json").read_text()))
    started = time.time()
    record = replicate.run_one(spec, SCALE, out, data, out / "tokenizer", zero_shot=False)
    run_dir = out / name
    routing = None
    if record["fields"]["attention_type"] == "switchhead":
        routing = replicate.routing_statistics(run_dir, data, block_size=SCALE.block_size)
    starts = json.loads((out / "specs" / f"{name}.starts.json").read_text())
    tokens_per_step = SCALE.batch_size * SCALE.block_size
    record.update(
        learning_rate=spec.training["learning_rate"], position=spec.comparison, routing=routing,
        routing_summary=routing_summary(routing), code=starts, finished_code=git_state(),
        step_seconds_median=tokens_per_step / record["train"]["tokens_per_second_median"],
        finishing_seconds=time.time() - started, torch_threads=threads)
    write_json(run_dir / FINISHED, record)
    return 0


def routing_summary(routing: dict | None) -> dict | None:
    """Over every router and head: mean and minimum normalised entropy of expert use, smallest expert share."""
    if not routing:
        return None
    entropies = [e for stats in routing.values() for e in stats["normalised_entropy"]]
    shares = [v for stats in routing.values() for row in stats["share"] for v in row]
    return dict(routers=len(routing), entropy_mean=sum(entropies) / len(entropies), entropy_min=min(entropies),
                share_min=min(shares), share_max=max(shares))


# ================================================================================================ results
ANALYSIS = """\
## Analysis, stated before the runs

* **Learning rate**: each of SwitchHead, the same-total-heads dense baseline and the gated control gets its own
  lr, chosen on seed 0 by WikiText-2 *validation* perplexity (sliding window, the split's first half, cut at a
  line end) from {LRS} (extended by x2 or /2 when the best is at an edge). Test perplexity never chooses anything.
* **Main comparison**: seeds 0, 1, 2 of the three at their own best lr (seed 0 is the sweep run). Reported:
  test perplexity (whole WikiText-2 test split, sliding window: context {T}, stride {S}) as mean ± sample sd, and
  the **paired difference by seed** (SwitchHead − baseline, same seed = same initialisation seed and data order)
  with its mean, sd and each seed's value. "SwitchHead beats the gated control" means the paired test difference
  is negative for every seed; with 3 seeds nothing finer is claimed.
* **Same active heads** (1 seed, at the same-total-heads baseline's lr): reported beside, not tuned.
* **Where the experts start to matter** (seed 0, SwitchHead's best lr): E in {{2, 5, 8}} at k=2 (E=1 is the gated
  control's idea with H=2), value-only and output-only experts; differences smaller than the seed sd of the
  main comparison are read as no difference.
* **XL pair** (seed 0, RoPE-chosen lrs): the same three models with Transformer-XL positions.
* **Costs**: attention MACs and memory per layer and sequence (`cost_report`, the paper's accounting), parameters,
  median wall-clock per training step on the machine named below (1 torch thread, nice 19, shared machine: the load is
  recorded with each run), peak memory, process CPU seconds. Routing: per router and head the share of top-k
  picks per expert and its normalised entropy (1 = uniform) on 16K validation tokens.
* **Zero-shot** BLiMP (67 paradigms x first 100 pairs) and LAMBADA (first 1,000 passages) of the 3-seed models,
  as a separate step after the grid (`--zero-shot`).
* Validation perplexity against training tokens (the trainer's periodic evaluation on {EB} validation batches):
  one picture per comparison.
"""


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.2f}" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")


def _ppl(record: dict, split: str) -> float:
    return record["perplexity"][split]["perplexity"]


def summarise(records: dict[str, dict]) -> dict:
    """The numbers of the results pages (also stored in the JSON)."""
    sweeps = {role: sweep_of(role, records) for role in MAIN_ROLES}
    best = {role: chosen for role, (_, chosen) in sweeps.items() if chosen is not None}
    summary: dict = {"best_lr": best, "sweep": {}, "main": {}, "paired": [], "experts": [], "xl": []}
    for role, (lrs, _) in sweeps.items():
        summary["sweep"][role] = {lr_tag(lr): {k: _ppl(records[n], k) for k in ("valid", "test")}
                                  for lr in sorted(lrs) if (n := model_spec(role, lr, 0).name) in records}
    for role in MAIN_ROLES:
        if role in best:
            seeds = {s: records[n] for s in range(SCALE.seeds)
                     if (n := model_spec(role, best[role], s).name) in records}
            summary["main"][role] = {str(s): {k: _ppl(r, k) for k in ("valid", "test")} for s, r in seeds.items()}
    main = summary["main"]
    for baseline in ("gate", "dense-total"):
        if "switchhead" in main and baseline in main:
            seeds = sorted(set(main["switchhead"]) & set(main[baseline]))
            for split in ("valid", "test"):
                diffs = [main["switchhead"][s][split] - main[baseline][s][split] for s in seeds]
                ratios = [main["switchhead"][s][split] / main[baseline][s][split] for s in seeds]
                if diffs:
                    summary["paired"].append(dict(
                        baseline=baseline, split=split, seeds=[int(s) for s in seeds], differences=diffs,
                        mean=sum(diffs) / len(diffs), sd=statistics.stdev(diffs) if len(diffs) > 1 else None,
                        ratio_mean=sum(ratios) / len(ratios), all_negative=all(d < 0 for d in diffs)))
    if "switchhead" in best:
        for role in ("switchhead", "gate", "E2", "E8", "Vonly", "Oonly"):
            lr = best.get(role) if role == "gate" else best["switchhead"]
            if lr is not None and (n := model_spec(role, lr, 0).name) in records:
                summary["experts"].append(dict(run=n, role=role, valid=_ppl(records[n], "valid"),
                                               test=_ppl(records[n], "test")))
    if "dense-total" in best and (n := model_spec("dense-active", best["dense-total"], 0).name) in records:
        summary["dense_active"] = dict(run=n, valid=_ppl(records[n], "valid"), test=_ppl(records[n], "test"))
    for role in MAIN_ROLES:
        if role in best and (n := model_spec(role, best[role], 0, "xl").name) in records:
            summary["xl"].append(dict(run=n, role=role, valid=_ppl(records[n], "valid"), test=_ppl(records[n], "test")))
    return summary


def comparisons(records: dict[str, dict], summary: dict) -> dict[str, tuple[str, list[dict]]]:
    """Picture name -> (title, the runs in it)."""
    best = summary["best_lr"]
    pictures = {}
    for role in MAIN_ROLES:
        runs = [r for r in records.values() if r["role"] == role and r["seed"] == 0 and r["position"] == "rope"]
        pictures[f"sweep_{role}"] = (f"lr sweep, seed 0: {role}", runs)
    main = [r for r in records.values() if r["position"] == "rope" and (
        (r["role"] in best and r["learning_rate"] == best[r["role"]]) or r["role"] == "dense-active")]
    pictures["main"] = ("SwitchHead vs dense vs gated control at own best lr (one line per seed)", main)
    sh = best.get("switchhead")
    experts = [r for r in records.values() if r["position"] == "rope" and r["seed"] == 0 and (
        (r["role"] in ("switchhead", "E2", "E8", "Vonly", "Oonly") and r["learning_rate"] == sh) or
        (r["role"] == "gate" and r["learning_rate"] == best.get("gate")))]
    pictures["experts"] = ("Expert count (k=2) and expert sides, seed 0", experts)
    pictures["xl"] = ("Transformer-XL positions, seed 0", [r for r in records.values() if r["position"] == "xl"])
    return pictures


def plot(title: str, runs: list[dict], path: Path) -> bool:
    """Validation perplexity (the trainer's periodic evaluation) against training tokens, one line per run."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        path.unlink(missing_ok=True)
        return False
    figure, axis = plt.subplots(figsize=(8, 4.8))
    colours: dict[str, str] = {}
    tokens_per_step = SCALE.batch_size * SCALE.block_size
    for run in sorted(runs, key=lambda r: (r["model"], r["seed"])):
        colour = colours.setdefault(run["model"], f"C{len(colours) % 10}")
        curve = run["curve"]
        axis.plot([s * tokens_per_step / 1e6 for s in curve["valid_step"]], [math.exp(v) for v in curve["valid_loss"]],
                  color=colour, marker="o", ms=3, lw=1, alpha=0.85,
                  label=textwrap.fill(run["label"], LEGEND_WIDTH, subsequent_indent="    ")
                  if run["seed"] == min(r["seed"] for r in runs if r["model"] == run["model"]) else None)
    finals = [math.exp(r["curve"]["valid_loss"][-1]) for r in runs]
    axis.set_ylim(min(finals) * 0.9, max(finals) * 2.0)
    axis.set_yscale("log")
    axis.set_xlabel("training tokens (millions)")
    axis.set_ylabel(f"validation perplexity ({SCALE.eval_batches} batches)")
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3, which="both")
    # under the axes, not on them: a label can be longer than the axes are wide, and a legend placed on the axes then
    # runs off the figure's edge (bbox_inches="tight" grows the figure to hold it)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.13), frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(figure)
    return True


def write_results(out: Path, results_dir: Path, written: str | None = None, machine: dict | None = None) -> dict:
    """Rewrite the results pages from the finished runs; `written`, `machine`: the stamp on them (default: now,
    this machine)."""
    from switchhead.evaluation.accounting import format_count

    records = finished_records(out, results_dir)
    add_timing(out, records)
    runs, undecided = plan(records)
    summary = summarise(records)
    failed = failures(out)
    report = dict(scale=dataclasses.asdict(SCALE), steps_note=STEPS_NOTE, learning_rates=list(LEARNING_RATES),
                  machine=dict(machine) if machine else replicate.machine(),
                  written=written or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  finished=list(records), planned_not_finished=[
                      s.name for s in runs if s.name not in records], undecided=undecided, failed=failed,
                  summary=summary, runs=records)
    # the runs' thread count, not this report-writing process's
    report["machine"]["torch_threads"] = ", ".join(str(t) for t in sorted({r["torch_threads"] for r in
                                                                            records.values()})) or None
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{STEM}.json").write_text(json.dumps(report, indent=1))

    s = SCALE
    lines = ["# Replication at the `cpu` scale: do the experts matter?", "",
             f"Generated by `experiments/replicate_cpu.py` at {report['written']} from the run folders "
             f"(`python experiments/replicate_cpu.py --report-only` regenerates it). The grid runs in the background: "
             "`experiments/run_cpu_grid.sh` starts or resumes it (finished runs are skipped, an interrupted one "
             "continues from its checkpoint); `kill -STOP -$(cat OUT/grid.pgid)` (OUT: the run folder) pauses it and "
             "`kill -CONT -$(cat OUT/grid.pgid)` resumes it.", "",
             f"Scale: {s.about}; {STEPS_NOTE}. Every model: the same {s.vocab_size}-token BPE tokenizer trained on "
             f"WikiText-2 train, AdamW (wd 0), {s.warmup_steps} warmup steps then cosine to 0, gradient clip "
             f"{s.grad_clip}, dropout {s.hidden_dropout}, batch {s.batch_size} x {s.block_size}. Dense baselines and "
             "ablations are parameter-matched to SwitchHead through their MLP width.", "",
             ANALYSIS.format(LRS=", ".join(f"{lr:g}" for lr in LEARNING_RATES), T=s.block_size, S=s.block_size // 2,
                             EB=s.eval_batches),
             "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if v is not None) + ".", ""]
    if records:
        first = min(records.values(), key=lambda r: r["code"][0]["at"])
        lines.append(f"Measured here: the first run ({first['name']}) trained at a median "
                     f"{first['train']['tokens_per_second_median']:.0f} tokens/s wall "
                     f"({first['step_seconds_median']:.2f} s per step) with {first['torch_threads']} torch thread(s).")
        timed = [r for r in records.values() if r["timing_complete"] and not math.isnan(r["wall_seconds"])]
        if timed:
            cpu, wall = (statistics.mean(r[k] for r in timed) for k in ("cpu_seconds", "wall_seconds"))
            left = len(report["planned_not_finished"])
            lines[-1] += (f" The {len(timed)} run(s) timed from start to end took {cpu / 60:.1f} CPU-minutes and "
                          f"{wall / 60:.1f} wall-minutes on average, training and evaluation. Estimate, not a "
                          f"measurement: the {left} runs decided but not finished need about {left * cpu / 3600:.1f} "
                          f"more CPU-hours ({left * wall / 3600:.1f} h wall at the same load; more if a sweep "
                          "extends).")
        lines.append("")

    lines += ["## Learning-rate sweep (seed 0; validation perplexity chooses)", "",
              "| model | " + " | ".join(f"lr {lr:g}" for lr in sorted(
                  {lr for role in MAIN_ROLES for lr in sweep_of(role, records)[0]})) + " | chosen |",
              ]
    all_lrs = sorted({lr for role in MAIN_ROLES for lr in sweep_of(role, records)[0]})
    lines.append("|---" * (len(all_lrs) + 2) + "|")
    for role in MAIN_ROLES:
        row = summary["sweep"].get(role, {})
        cells = [f"{row[lr_tag(lr)]['valid']:.2f} (test {row[lr_tag(lr)]['test']:.2f})" if lr_tag(lr) in row else "-"
                 for lr in all_lrs]
        chosen = summary["best_lr"].get(role)
        lines.append(f"| {role} | " + " | ".join(cells) + f" | {f'{chosen:g}' if chosen else 'not yet'} |")
    lines += ["", "Cells: validation perplexity (first half of the split) and, in brackets, test perplexity (the "
              "whole split); "
              "sliding window.", ""]

    lines += ["## Main comparison: own best lr, seeds 0-2", "",
              "| model | lr | attn MACs/layer | attn mem/layer | seeds | valid ppl | test ppl | test ppl per seed | "
              "BLiMP % | LAMBADA % |", "|---|---|---|---|---|---|---|---|---|---|"]

    def costs(run: str) -> str:
        return (f"{format_count(records[run]['costs']['attention_macs_table'])} | "
                f"{format_count(records[run]['costs']['attention_memory_table'])}")

    for role, seeds in summary["main"].items():
        zero = [z for s in seeds if (z := records[model_spec(role, summary["best_lr"][role], int(s)).name].get(
            "zero_shot"))]
        lines.append(f"| {role} | {summary['best_lr'][role]:g} | "
                     f"{costs(model_spec(role, summary['best_lr'][role], int(next(iter(seeds)))).name)} | "
                     f"{len(seeds)} | "
                     f"{_mean_sd([v['valid'] for v in seeds.values()])} | "
                     f"{_mean_sd([v['test'] for v in seeds.values()])} | "
                     + ", ".join(f"s{k}: {v['test']:.2f}" for k, v in sorted(seeds.items())) + " | "
                     + (f"{_mean_sd([100 * z['blimp_acc'] for z in zero])} ({len(zero)}) | "
                        f"{_mean_sd([100 * z['lambada_acc'] for z in zero])} ({len(zero)})" if zero else "- | -")
                     + " |")
    if "dense_active" in summary:
        d = summary["dense_active"]
        lines.append(f"| dense-active (same active heads) | {summary['best_lr']['dense-total']:g} | "
                     f"{costs(d['run'])} | 1 | "
                     f"{d['valid']:.2f} | {d['test']:.2f} | s0: {d['test']:.2f} | - | - |")
    lines += ["", "Paired differences, SwitchHead − baseline, by seed (negative: SwitchHead better):", "",
              "| baseline | split | seeds | per seed | mean ± sd | mean ratio | negative for every seed |",
              "|---|---|---|---|---|---|---|"]
    for p in summary["paired"]:
        lines.append(f"| {p['baseline']} | {p['split']} | {len(p['seeds'])} | "
                     + ", ".join(f"{d:+.2f}" for d in p["differences"]) + f" | {p['mean']:+.2f}"
                     + (f" ± {p['sd']:.2f}" if p["sd"] is not None else "") + f" | {p['ratio_mean']:.3f} | "
                     f"{'yes' if p['all_negative'] else 'no'} |")
    lines.append("")
    if summary["experts"]:
        lines += ["## Expert count and sides (seed 0)", "",
                  "| run | model | attn MACs/layer | attn mem/layer | valid ppl | test ppl |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {e['run']} | {records[e['run']]['label']} | "
                  f"{format_count(records[e['run']]['costs']['attention_macs_table'])} | "
                  f"{format_count(records[e['run']]['costs']['attention_memory_table'])} | {e['valid']:.2f} | "
                  f"{e['test']:.2f} |" for e in summary["experts"]]
        lines.append("")
    if summary["xl"]:
        lines += ["## Transformer-XL positions (seed 0)", "", "| run | attn MACs/layer | attn mem/layer | valid ppl | "
                  "test ppl |", "|---|---|---|---|---|"]
        lines += [f"| {e['run']} | {costs(e['run'])} | {e['valid']:.2f} | {e['test']:.2f} |" for e in summary["xl"]]
        lines.append("")

    lines += ["## Every finished run: costs and routing", "",
              "| run | code | params | attn MACs/layer | attn mem/layer | valid ppl | test ppl | s/step (median) | "
              "train tok/s | peak MB | CPU s | load (1 min, start/end) | routing entropy mean / min | expert share "
              "min / max | BLiMP % | LAMBADA % |", "|---" * 16 + "|"]
    for name, r in records.items():
        costs, rs, zero = r["costs"], r.get("routing_summary"), r.get("zero_shot")
        dirty = any(changes_to_code(start["dirty"]) for start in r["code"])
        code = r["code"][0]["commit"][:8] + ("+dirty" if dirty else "") + (
            f" (+{len(r['code']) - 1} resumes)" if len(r["code"]) > 1 else "")
        load = r["train"].get("load_average_1min") or [math.nan, math.nan]
        lines.append(
            f"| {name} | {code} | {r['parameters']:,} | {format_count(costs['attention_macs_table'])} | "
            f"{format_count(costs['attention_memory_table'])} | {_ppl(r, 'valid'):.2f} | {_ppl(r, 'test'):.2f} | "
            f"{r['step_seconds_median']:.2f} | {r['train']['tokens_per_second_median']:.0f} | "
            f"{r['train']['peak_memory_mb']:.0f} | {'' if r['timing_complete'] else '>= '}{r['cpu_seconds']:.0f} | "
            f"{load[0]:.1f} / {load[1]:.1f} | "
            + (f"{rs['entropy_mean']:.3f} / {rs['entropy_min'] + 0.0:.3f} | "  # + 0.0: -0.0 prints as 0.000
               f"{rs['share_min']:.3f} / {rs['share_max']:.3f}"
               if rs else "- | -") + " | "
            + (f"{100 * zero['blimp_acc']:.1f} | {100 * zero['lambada_acc']:.1f}" if zero else "- | -") + " |")
    lines += ["", "Code: the commit each run started from (a resume may start from a later one; every start is in the "
              "JSON); +dirty where a start had uncommitted changes other than these results pages.",
              "", "Not finished yet (in grid order): " + (", ".join(report["planned_not_finished"]) or "none") + ".",
              ("Not yet decided: " + "; ".join(undecided) + ".") if undecided else "Every run of the grid is decided.",
              ("Failed (left out after " + str(MAX_ATTEMPTS) + " tries): " + ", ".join(failed) + ".") if failed
              else "", ""]
    for key, (title, chosen) in comparisons(records, summary).items():
        image = results_dir / f"{STEM}_{key}.png"
        if plot(title, chosen, image):
            lines += [f"![{title}]({image.name})", ""]
    target = results_dir / f"{STEM}.md"
    kept = ""
    if target.is_file() and replicate.READING_MARKER in target.read_text():
        kept = target.read_text().split(replicate.READING_MARKER, 1)[1]
    target.write_text("\n".join(lines) + "\n" + replicate.READING_MARKER + kept)
    return report


# ================================================================================================ driver
def failures(out: Path) -> list[str]:
    attempts = out / "attempts.json"
    counts = json.loads(attempts.read_text()) if attempts.is_file() else {}
    return sorted(name for name, count in counts.items() if count >= MAX_ATTEMPTS
                  and not (out / name / FINISHED).is_file())


def read_timing(specs_dir: Path, name: str) -> dict:
    """CPU and wall seconds of a run's timed attempts, and their number (a bare number: an older driver's CPU
    seconds of one attempt)."""
    path = specs_dir / f"{name}.cpu.json"
    value = json.loads(path.read_text()) if path.is_file() else dict(cpu_seconds=0.0, wall_seconds=0.0, attempts=0)
    if not isinstance(value, dict):
        value = dict(cpu_seconds=float(value), wall_seconds=math.nan, attempts=1)
    return value


def add_timing(out: Path, records: dict[str, dict]) -> None:
    """Each record's CPU / wall seconds, complete only when every start of the run was timed to its end."""
    for name, record in records.items():
        starts = out / "specs" / f"{name}.starts.json"
        if not starts.is_file() and "cpu_seconds" in record:
            continue  # a run an earlier machine finished: its record keeps the timing measured there
        timing = read_timing(out / "specs", name)
        started = len(json.loads(starts.read_text())) if starts.is_file() else 0
        record.update(cpu_seconds=timing["cpu_seconds"], wall_seconds=timing["wall_seconds"],
                      timing_complete=timing["attempts"] >= started > 0)


def run_grid(args) -> int:
    import grid_driver  # here, not at the top: grid_driver imports this module

    return grid_driver.run_grid(args, Path(__file__).resolve(), lambda: finished_records(args.out, args.results_dir),
                                plan)


def unscored(record: dict | None) -> bool:
    """Whether a finished run still needs its zero-shot scores (every record is written with `zero_shot: None`)."""
    return record is not None and not record.get("zero_shot")


def zero_shot(args) -> int:
    """BLiMP / LAMBADA of every finished 3-seed model run (the main comparison at its best lr); records updated."""
    import torch

    torch.set_num_threads(args.threads)
    records = finished_records(args.out, args.results_dir)
    best = summarise(records)["best_lr"]
    for role, lr in best.items():
        for seed in range(SCALE.seeds):
            name = model_spec(role, lr, seed).name
            if not unscored(records.get(name)):
                continue
            if not (args.out / name).is_dir():
                print(f"[zero-shot] {name}: finished on an earlier machine, its weights are not here; not scored",
                      flush=True)
                continue
            scored = args.out / name / "zero_shot.json"
            if not scored.is_file():
                print(f"[zero-shot] {name}", flush=True)
                scored.write_text(json.dumps(replicate.zero_shot_eval(args.out / name, SCALE, "cpu"), indent=1))
            record = records[name]
            record["zero_shot"] = json.loads(scored.read_text())
            write_json(args.out / name / FINISHED, record)
    write_results(args.out, args.results_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    import grid_driver  # here, not at the top: grid_driver imports this module

    parser = grid_driver.parser(__doc__.split("\n\n")[0], REPO / "runs" / "replication-cpu")
    parser.add_argument("--zero-shot", action="store_true", help="BLiMP / LAMBADA of the 3-seed models")
    parser.add_argument("--then-zero-shot", action="store_true",
                        help="when every run of the grid has finished, go on with --zero-shot")
    args = parser.parse_args(argv)
    if args.tiny:
        use_tiny()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    replicate.split_file(args.data, "train")
    if args.run is not None:
        return run_child(args.run, args.out, args.data, args.threads)
    if args.pgid_file is not None:
        args.pgid_file.write_text(f"{os.getpgid(0)}\n")
    replicate.ensure_tokenizer(args.out, args.data, SCALE.vocab_size)
    if args.list:
        return grid_driver.print_plan(finished_records(args.out, args.results_dir), plan, 32)
    if args.report_only:
        stamp = grid_driver.committed_stamp(args.results_dir, STEM) if args.same_stamp else {}
        write_results(args.out, args.results_dir, **stamp)
        return 0
    if args.zero_shot:
        return zero_shot(args)
    code = run_grid(args)
    if code == 0 and args.then_zero_shot and not args.only:
        code = subprocess.call([sys.executable, os.path.abspath(__file__), "--out", str(args.out), "--data",
                                args.data, "--results-dir", str(args.results_dir), "--threads", str(args.threads),
                                "--zero-shot"] + (["--tiny"] if args.tiny else []))
    return code


if __name__ == "__main__":
    sys.exit(main())
