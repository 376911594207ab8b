"""Is it the routing or the second projection? And is SwitchHead level with the gated control? The second grid after
`experts_vs_gate.py`, at the same `cpu` scale and training (its SCALE, lr ladder, statistic and verdict rule).

The first grid found A (SwitchHead, E=5 k=2) better than B (the same shape, E=1 k=1) by about 2.4%. But A differs
from B twice: it chooses among experts, and it has two active gated projections per side where B has one. Two arms
separate the halves (both at A's shape, parameter-matched to A through the MLP width, d_ff):

    D  E=2 k=2: two gated projections per side, both always active (no choice among them)
    E  E=5 k=1: a choice among five experts, one active projection per side

    A - D: does choosing among experts help beyond having two gated projections?
    A - E: does the second active projection help?

The first grid's A - C (SwitchHead against dense H=8 with an output gate) was inconclusive; adding seeds to it after
seeing it would be optional stopping, so A and C run again on five seed indices the first grid did not use, and
A - C is read on those fresh seeds alone (the first grid's A - C stays as it was reported).

Seeds and pairing (same seed index = same initialisation seed and data order):

    D, E  lr sweep on seed 0 at 4e-3, 2.8e-3, 5.7e-3 (extended at an edge, as in the first grid), then seeds 1-4 at
          the best lr; seeds 0-4 pair with the first grid's A seeds 0-4 (A at its lr, 4e-3).
    A, C  seeds 5-9 at the lr each chose in the first grid (read from its committed results page).

Order: the sweeps of D and E interleaved, then rounds of one seed each of A, C, D and E, so that an interim reading
has every comparison about equally far along. 24 runs (more if a sweep extends).

Resumable, low priority and pausable exactly as the first grid (the same driver, run child and records):

    experiments/run_routing_vs_projection.sh OUT      # start or resume in the background (nice 19, 1 thread)
    kill -STOP -$(cat OUT/grid.pgid)                  # pause (driver and its run); kill -CONT ... resumes
    python experiments/routing_vs_projection.py --out OUT --list          # the grid as decided now
    python experiments/routing_vs_projection.py --out OUT --report-only   # rewrite the results pages

Results: benchmarks/results/routing_vs_projection.{json,md} and routing_vs_projection.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experts_vs_gate as first  # noqa: E402  (the first grid: scale, lr ladder, arms, statistic, records)
import grid_driver  # noqa: E402  (the loop every grid shares)
import replicate  # noqa: E402
import replicate_cpu  # noqa: E402  (the run child, timing, plots)

REPO = replicate.REPO
STEM = "routing_vs_projection"
NEW_ARMS = ("D", "E")
NEW_SEEDS = (0, 1, 2, 3, 4)  # D and E; seed 0 is the sweep's run at the best lr
FRESH_SEEDS = (5, 6, 7, 8, 9)  # A and C: seed indices the first grid did not use (it used 0-4)
ARM_SEEDS = {"A": FRESH_SEEDS, "C": FRESH_SEEDS, "D": NEW_SEEDS, "E": NEW_SEEDS}
FIRST_GRID_A_SEEDS = NEW_SEEDS  # the first grid's A runs that D and E pair with
# (X, Y, seeds, where X's runs come from): the comparisons, each by the first grid's rule
COMPARISONS = (("A", "D", NEW_SEEDS, "first grid"), ("A", "E", NEW_SEEDS, "first grid"),
               ("A", "C", FRESH_SEEDS, "this grid"))
PLANNED_RUNS = 2 * len(first.SWEEP_RUNGS) + 2 * (len(NEW_SEEDS) - 1) + 2 * len(FRESH_SEEDS)  # before extensions
VERDICT_WORDS = {
    ("A", "D"): {"better": "choosing among experts helps beyond two gated projections",
                 "equivalent": "choosing among experts does not help beyond two gated projections (equivalent "
                               "within ±1%)", "inconclusive": "inconclusive"},
    ("A", "E"): {"better": "the second active projection helps",
                 "equivalent": "the second active projection does not help (equivalent within ±1%)",
                 "inconclusive": "inconclusive"},
    ("A", "C"): first.VERDICT_WORDS[("A", "C")],
}


# ================================================================================================ the grid
def first_grid_lrs(first_records: dict[str, dict]) -> dict[str, float | None]:
    """The lr A and C chose in the first grid (None while its records do not decide it)."""
    return {arm: first.sweep_of(arm, first_records)[1] for arm in ("A", "C")}


def plan(records: dict[str, dict], first_records: dict[str, dict]) -> tuple[list[replicate.RunSpec], list[str]]:
    """(the runs decided so far, in order; what is not yet decided and why). `records`: this grid's finished runs;
    `first_records`: the first grid's (its A and C lrs)."""
    runs: list[replicate.RunSpec] = []
    undecided: list[str] = []
    best: dict[str, float] = {}
    for rung in first.SWEEP_RUNGS:  # interleaved: every lr has D and E before the next lr
        runs += [first.model_spec(arm, first.lr_of(rung), 0) for arm in NEW_ARMS]
    for arm in NEW_ARMS:
        lrs, chosen = first.sweep_of(arm, records)
        runs += [first.model_spec(arm, lr, 0) for lr in lrs[len(first.SWEEP_RUNGS):]]
        if chosen is None:
            undecided.append(f"{arm}: best lr (its sweep is not finished), so its seeds")
        else:
            best[arm] = chosen
    for arm, lr in first_grid_lrs(first_records).items():
        if lr is None:
            undecided.append(f"{arm}: the lr the first grid chose (its results page does not decide it), so its "
                             "fresh seeds")
        else:
            best[arm] = lr
    # rounds: A and C's i-th fresh seed, D and E's (i+1)-th seed (their seed 0 is the sweep's)
    for i in range(max(len(FRESH_SEEDS), len(NEW_SEEDS) - 1)):
        for arm in ("A", "C", "D", "E"):
            seeds = ARM_SEEDS[arm] if arm in ("A", "C") else NEW_SEEDS[1:]
            if arm in best and i < len(seeds):
                runs.append(first.model_spec(arm, best[arm], seeds[i]))
    return runs, undecided


def first_grid_records(results_dir: Path | None) -> dict[str, dict]:
    """The first grid's finished runs, from its committed results page."""
    return first.committed_records(results_dir, first.STEM)


def finished_records(out: Path, results_dir: Path | None = None) -> dict[str, dict]:
    return first.finished_records(out, results_dir, STEM)


# ================================================================================================ the statistic
QUESTION = """\
## Question, arms, seeds and rule, fixed before the first run

The first grid ([experts_vs_gate.md](experts_vs_gate.md)) found A (SwitchHead, E={EX} k={K}) better than B (the same
shape with E=1 k=1) by about 2.4%. A differs from B twice: it **chooses** among experts, and it has **two active
gated projections** per side where B has one. This grid separates the two, and reads A − C again on fresh seeds.

* **D**: A's shape with E=2 k=2 — two gated projections per side, both always active, no choice among them.
* **E**: A's shape with E={EX} k=1 — a choice among {EX} experts, one active projection per side.
* **A − D**: does choosing among experts help beyond two gated projections? (D's seeds 0–4 against the first
  grid's A seeds 0–4.)
* **A − E**: does the second active projection help? (E's seeds 0–4 against the first grid's A seeds 0–4.)
* **A − C on fresh seeds**: A and C again on seed indices 5–9, which the first grid did not use, at the lr each
  chose there (A {LRA}, C {LRC}); compared on these five seeds alone. The first grid's A − C (inconclusive) stays
  as it was reported; its seeds are not pooled with these.

D and E are parameter-matched to A through the MLP width (d_ff), as B and C were. Each gets its own lr on seed 0
from {LRS} (validation perplexity chooses; a best at an edge of the sweep adds the next lr beyond it, at most
{MAXEXT} times), then seeds 1–4 at its best. Run order: the sweeps of D and E interleaved, then rounds of one seed
each of A, C, D and E, so that interim readings stay balanced. {N} runs (more if a sweep extends).

The statistic and the verdict rule are the first grid's: for X − Y, each seed s gives **delta_s = test NLL(X, s) −
test NLL(Y, s)** (mean negative log-likelihood per token on the whole WikiText-2 test split, sliding window), paired
by seed index; mean, sample sd, and t intervals mean ± t(q, n−1) · sd / sqrt(n) for q = 0.975 (95%) and 0.95 (90%).
The smallest effect of interest is **{EFFECT} nats (1%)**:

* **X better**: the 95% interval's upper end is below 0 **and** the mean is −{EFFECT} or lower.
* **no difference that matters**: the whole 90% interval lies inside ±{EFFECT} (equivalence).
* anything else: **inconclusive** (an interval entirely above 0, X worse, is named beside the verdict).

A verdict is final when both arms of its comparison have all five seeds; before that it is interim. No number of
this grid goes into the README before its verdict is final.

A's seeds 0–4 ran in the first grid, from earlier commits of the same code at the same scale and training; the
fresh A seeds 5–9 run here beside D and E, and the page shows A's mean test perplexity on both sets of seeds
(descriptive) as a check that A's level did not move between them.
"""


# ================================================================================================ summary
def summarise(records: dict[str, dict], first_records: dict[str, dict]) -> dict:
    """The numbers of the results pages (also stored in the JSON)."""
    sweeps = {arm: first.sweep_of(arm, records) for arm in NEW_ARMS}
    best = {arm: chosen for arm, (_, chosen) in sweeps.items() if chosen is not None}
    best.update({arm: lr for arm, lr in first_grid_lrs(first_records).items() if lr is not None})
    summary: dict = {"best_lr": best, "sweep": {}, "seeds": {}, "comparisons": []}
    for arm, (lrs, _) in sweeps.items():
        summary["sweep"][arm] = {replicate_cpu.lr_tag(lr): dict(valid=first.valid_perplexity(records[n]),
                                                                test=records[n]["perplexity"]["test"]["perplexity"])
                                 for lr in sorted(lrs) if (n := first.model_spec(arm, lr, 0).name) in records}
    at_best: dict[str, dict[int, dict]] = {}  # "A" (fresh), "C", "D", "E", and "A first grid"
    for arm, lr in best.items():
        at_best[arm] = {seed: records[n] for seed in ARM_SEEDS[arm]
                        if (n := first.model_spec(arm, lr, seed).name) in records}
    if "A" in best:
        at_best["A first grid"] = {seed: first_records[n] for seed in FIRST_GRID_A_SEEDS
                                   if (n := first.model_spec("A", best["A"], seed).name) in first_records}
    for key, runs in at_best.items():
        summary["seeds"][key] = {str(seed): dict(run=r["name"], test_nll=first.test_nll(r),
                                                 test_perplexity=r["perplexity"]["test"]["perplexity"],
                                                 valid_perplexity=first.valid_perplexity(r))
                                 for seed, r in runs.items()}
    for x, y, planned, source in COMPARISONS:
        x_key = "A first grid" if source == "first grid" else x
        if x_key not in at_best or y not in at_best:
            continue
        seeds = sorted(set(at_best[x_key]) & set(at_best[y]) & set(planned))
        if not seeds:
            continue
        summary["comparisons"].append(first.paired_comparison(
            at_best[x_key], at_best[y], seeds, lambda stat: dict(
                pair=f"{x} - {y}", x_runs=source, seeds=seeds, final=len(seeds) >= len(planned),
                words=first.verdict_words((x, y), stat, VERDICT_WORDS))))
    return summary


# ================================================================================================ results pages
def planned_count(runs: list[replicate.RunSpec], undecided: list[str]) -> int:
    """The runs the grid will have: those decided, and the seeds an undecided lr still holds back."""
    held = sum(len(NEW_SEEDS) - 1 for arm in NEW_ARMS if any(u.startswith(f"{arm}:") for u in undecided))
    held += sum(len(FRESH_SEEDS) for arm in ("A", "C") if any(u.startswith(f"{arm}:") for u in undecided))
    return len(runs) + held


def render(records: dict[str, dict], runs: list[replicate.RunSpec], undecided: list[str], failed: list[str],
           summary: dict, code: dict, written: str) -> list[str]:
    """The markdown results page (lines), from the records and the plan; no file access."""
    from switchhead.evaluation.accounting import format_count

    s = first.SCALE
    planned = [spec.name for spec in runs]
    not_finished = [name for name in planned if name not in records]
    done = [name for name in planned if name in records]
    total = planned_count(runs, undecided)
    complete = bool(planned) and not not_finished and not undecided
    lines = first.page_head("Is it the routing or the second projection?", STEM, "run_routing_vs_projection.sh",
                            code, written) + [
        (f"**Complete: all {len(planned)} runs have finished.**" if complete
         else f"**Progress: {len(done)} of {total} runs finished** ({len(planned)} decided so far"
         + (f"; next: {', '.join(not_finished[:4])}" if not_finished else "") + ")."
         + (" Not yet decided: " + "; ".join(undecided) + "." if undecided else "")), ""]
    lines += first.timing_lines(records, None if complete else total - len(done), "left",
                                caveat=", one run at a time (`--workers 2` runs two side by side, one per core: about "
                                "half the wall time where each has a core to itself)")
    if failed:
        lines += [f"Failed (left out after {first.MAX_ATTEMPTS} tries): {', '.join(failed)}.", ""]
    lines.append(QUESTION.format(
        EX=s.experts, K=s.k, LRA=_lr(summary["best_lr"].get("A")), LRC=_lr(summary["best_lr"].get("C")),
        LRS=", ".join(f"{first.lr_of(r):g}" for r in first.SWEEP_RUNGS), MAXEXT=first.MAX_EXTENSIONS,
        N=PLANNED_RUNS, EFFECT=first.EFFECT))

    lines += ["## Arms", "", "Attention MACs and memory per layer and sequence of "
              f"{s.block_size} tokens (`cost_report`, the paper's accounting), from a finished run of the arm.", "",
              "| arm | model | params | attn MACs/layer | attn mem/layer | seeds |", "|---|---|---|---|---|---|"]
    for arm in ("A", "C", "D", "E"):
        costs = first.arm_costs(records, arm)
        lines.append(f"| {arm} | {first.arm_fields(arm)[0]} | "
                     + (f"{costs['parameters']:,} | {format_count(costs['macs'])} | {format_count(costs['memory'])}"
                        if costs else "- | - | -") + " | " + _seed_range(ARM_SEEDS[arm])
                     + (" (and the first grid's 0–4)" if arm == "A" else "") + " |")
    lines += ["", f"Training: {s.about}; as in the first grid (tokenizer, AdamW, {s.warmup_steps} warmup steps then "
              "cosine, validation on the first half of WikiText-2 valid, test on the whole test split).", ""]

    lines += ["## Verdicts", ""]
    if not summary["comparisons"]:
        lines += ["No comparison has runs of both arms yet: no verdict.", ""]
    else:
        lines += first.verdict_table(summary["comparisons"], ("X's runs", "x_runs"))

    lines += ["## Learning-rate sweep of D and E (seed 0; validation perplexity chooses)", ""] + first.sweep_table(
        NEW_ARMS, records, summary)

    lines += ["## Seeds at each arm's lr", "", "| arm | lr | seeds | test ppl mean ± sd | test NLL per seed |",
              "|---|---|---|---|---|"]
    for key, seeds in summary["seeds"].items():
        arm = key.split()[0]
        ppl = [v["test_perplexity"] for v in seeds.values()]
        expected = FIRST_GRID_A_SEEDS if key == "A first grid" else ARM_SEEDS[arm]
        lines.append(f"| {key} | {summary['best_lr'][arm]:g} | {len(seeds)} of {len(expected)} | "
                     + replicate_cpu._mean_sd(ppl) + " | "
                     + ", ".join(f"s{k}: {v['test_nll']:.4f}" for k, v in sorted(seeds.items(), key=lambda kv:
                                                                                 int(kv[0]))) + " |")
    lines += ["", "\"A first grid\": the first grid's A runs that D and E pair with (from its committed results page).",
              ""]

    lines += ["## Every finished run of this grid", ""] + first.finished_runs_table(records, STEM) + [
              "Not finished yet (in grid order): " + (", ".join(not_finished) or "none") + ".", ""]
    return lines


def _lr(lr: float | None) -> str:
    return "not yet" if lr is None else f"{lr:g}"


def _seed_range(seeds: tuple[int, ...]) -> str:
    return f"{seeds[0]}–{seeds[-1]}"


def write_results(out: Path, results_dir: Path, data: str | None = None, code: dict | None = None,
                  written: str | None = None, machine: dict | None = None) -> dict:
    """Rewrite the results pages from the finished runs; `code`, `written`, `machine`: the stamp on them (default:
    the checkout's state from git, now, this machine)."""
    records = finished_records(out, results_dir)
    first_records = first_grid_records(results_dir)
    replicate_cpu.add_timing(out, records)
    runs, undecided = plan(records, first_records)
    summary = summarise(records, first_records)
    failed = replicate_cpu.failures(out)
    code = first.code_state(STEM) if code is None else code
    written = written or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = machine or {k: v for k, v in replicate.machine().items() if k != "host"}
    report = dict(scale=dataclasses.asdict(first.SCALE), learning_rates=[first.lr_of(r) for r in first.SWEEP_RUNGS],
                  seeds={arm: list(seeds) for arm, seeds in ARM_SEEDS.items()},
                  first_grid=dict(page=f"{first.STEM}.json", a_seeds=list(FIRST_GRID_A_SEEDS)),
                  effect=first.EFFECT, code=code, machine=machine, written=written, finished=list(records),
                  planned=[spec.name for spec in runs], planned_runs=planned_count(runs, undecided),
                  undecided=undecided, failed=failed, summary=summary, runs=records)
    lines = render(records, runs, undecided, failed, summary, code, written)
    best = summary["best_lr"]
    curves = [r for r in records.values() if r["role"] in best and r["learning_rate"] == best[r["role"]]]
    return first.publish(report, lines, results_dir, STEM, out, data, curves,
                         "Validation perplexity at each arm's lr (one line per seed)")


# ================================================================================================ driver
def main(argv: list[str] | None = None) -> int:
    args = grid_driver.parser(__doc__.split("\n\n")[0], REPO / "runs" / "routing-vs-projection").parse_args(argv)
    if args.tiny:
        first.use_tiny()
    if (code := grid_driver.start(args, first.SCALE)) is not None:
        return code
    first_records = first_grid_records(args.results_dir)
    if args.list:
        return grid_driver.print_plan(finished_records(args.out, args.results_dir),
                                      lambda records: plan(records, first_records))
    if args.report_only:
        stamp = grid_driver.committed_stamp(args.results_dir, STEM) if args.same_stamp else {}
        write_results(args.out, args.results_dir, args.data, **stamp)
        return 0
    replicate.ensure_tokenizer(args.out, args.data, first.SCALE.vocab_size)
    return grid_driver.run_grid(args, Path(__file__).resolve(), lambda: finished_records(args.out, args.results_dir),
                                lambda records: plan(records, first_records))


if __name__ == "__main__":
    sys.exit(main())
