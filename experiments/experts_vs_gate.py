"""Do the experts matter beyond the gate? SwitchHead against its own shape with one expert per head, as one
resumable background grid at the `cpu` scale (d=192, 6 layers, about 5.8M parameters, WikiText-2).

The earlier `cpu` grid (`replicate_cpu.py`) compared SwitchHead with a "gated control" that differs from it in five
ways at once (8 heads instead of 2, head size, an output gate only, no experts, no routing). The arm that isolates the
experts is SwitchHead's own shape with E=1, k=1: the same heads, head size and sigmoid gates on value and output, but
one expert per head, so no choice among experts. Arms (every one parameter-matched to A through its MLP width):

    A  SwitchHead H=2 dh=32, E=5 experts per head, k=2, sigmoid expert gates on value and output
    B  the same shape, E=1 k=1: one gated value and one gated output projection per head (no routing)
    C  dense H=8 dh=24 with a per-head sigmoid output gate, no value gate, no experts (the earlier gated control)

A fourth arm, dense H=8 with a learned per-head constant scale instead of an input-dependent gate, would separate
gating from rescaling; SwitchHeadConfig has no such option, so it is not part of this grid.

Every run: 1,200 steps of 16 x 256 tokens (4.9M tokens, about 1.7 epochs of the training split), warmup 100 then
cosine to 0, validation loss every 240 steps (the report shows how the differences move with the budget), then
sliding-window perplexity on the first half of WikiText-2 valid (chooses the lr) and on all of test (the statistic).

Order (the verdict on A - B can be read as early as possible):

    1. lr sweep, seed 0, of A and B interleaved: 4e-3, 2.8e-3, 5.7e-3 (steps of sqrt 2). An arm whose best
       validation perplexity is at an edge of its sweep gets the next lr beyond that edge (up to MAX_EXTENSIONS).
    2. seeds 1-4 of A and B at their own best lr, alternating A, B (seed 0 is the sweep's run).
    3. C: its lr sweep (same rule), then seeds 1 and 2 at its best lr.

The statistic is fixed here, before the results (STATISTIC below, printed on the results page).

Resumable and low priority exactly as `replicate_cpu.py` (its run child, records and timing are reused): every run is a
child process in its own folder under --out; a run with `grid_record.json` is finished and never run again; an
interrupted run resumes from its newest checkpoint. The results pages are rewritten after every finished run.

    experiments/run_experts_vs_gate.sh OUT           # start or resume in the background (nice 19, 1 thread)
    kill -STOP -$(cat OUT/grid.pgid)                 # pause (driver and its run); kill -CONT ... resumes
    python experiments/experts_vs_gate.py --out OUT --list          # the grid as decided now
    python experiments/experts_vs_gate.py --out OUT --report-only   # rewrite the results pages
    python experiments/experts_vs_gate.py --out OUT --report-only --docs   # ... and docs/results.md's section
                                                     # (--docs PAGE: that page's section)

Results: benchmarks/results/experts_vs_gate.{json,md} and experts_vs_gate.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replicate  # noqa: E402  (the run machinery: run_one, the model fields)
import replicate_cpu  # noqa: E402  (the resumable grid's run child, records, timing and plots)
import grid_driver  # noqa: E402  (the loop every grid shares)

REPO = replicate.REPO
RESULTS_DIR = replicate.RESULTS_DIR
DOCS_PAGE = REPO / "docs" / "results.md"
STEM = "experts_vs_gate"
FINISHED = replicate_cpu.FINISHED
MAX_ATTEMPTS = replicate_cpu.MAX_ATTEMPTS

STEPS = 1200
SCALE = dataclasses.replace(
    replicate.SCALES["cpu"], max_steps=STEPS, warmup_steps=100, eval_every=240, eval_batches=16, save_every=120,
    seeds=5, valid_fraction=0.5, about=f"d=192, 6 layers, ~5.8M parameters (3.1M of them embeddings/output), T=256, "
    f"{STEPS} steps x 16 x 256 = {STEPS * 16 * 256 / 1e6:.2f}M tokens (1.7 epochs of the 2.84M-token training split)")
# learning rates on a ladder of sqrt(2) steps around LR_CENTRE, rounded to two digits: rung -1, 0, 1 = 2.8e-3, 4e-3,
# 5.7e-3; an extension adds rung -2 (2e-3) or 2 (8e-3), then -3 (1.4e-3) or 3 (1.1e-2)
LR_CENTRE = 4e-3
SWEEP_RUNGS = (0, -1, 1)  # run order
MAX_EXTENSIONS = 2
ARMS = ("A", "B", "C")
SEEDS = {"A": 5, "B": 5, "C": 3}
EFFECT = 0.01  # the smallest effect of interest: 1% of perplexity, 0.01 nats of test NLL
COMPARISONS = (("A", "B"), ("A", "C"))


def use_tiny() -> None:
    """Tiny models and short runs for the tests (seconds per run); passed on to every child with --tiny."""
    global SCALE, LR_CENTRE
    SCALE = dataclasses.replace(replicate.SCALES["smoke"], max_steps=20, warmup_steps=2, save_every=10,
                                eval_every=10, eval_batches=1, seeds=5, hidden_dropout=0.1, about="tiny (tests)")
    LR_CENTRE = 2e-3


def lr_of(rung: int) -> float:
    return float(f"{LR_CENTRE * 2 ** (rung / 2):.2g}")


# ================================================================================================ the grid
def arm_fields(arm: str) -> tuple[str, dict, bool]:
    """(description by heads, experts and gates; SwitchHeadConfig fields; parameter-matched through d_ff)."""
    s = SCALE
    if arm == "A":
        return (f"SwitchHead H={s.heads} dh={s.head_dim}, E={s.experts} k={s.k}, sigmoid expert gates on value and "
                "output", replicate.switchhead_fields(s, "rope"), False)
    if arm == "B":
        return (f"SwitchHead shape H={s.heads} dh={s.head_dim}, E=1 k=1 (no routing), sigmoid gates on value and "
                "output", replicate.switchhead_fields(s, "rope", 1, 1), True)
    if arm == "C":
        return (f"dense H={s.dense_heads} dh={s.dense_head_dim}, sigmoid output gate per head, no value gate, no "
                "experts (the earlier gated control)",
                replicate.dense_fields(s, "rope", s.dense_heads, s.dense_head_dim, gate=True), True)
    # the arms of the second grid (routing_vs_projection.py): which half of A's difference from B matters
    if arm == "D":
        return (f"SwitchHead shape H={s.heads} dh={s.head_dim}, E=2 k=2 (both experts always active: two gated "
                "projections per side, no choice among them), sigmoid expert gates on value and output",
                replicate.switchhead_fields(s, "rope", 2, 2), True)
    if arm == "E":
        return (f"SwitchHead shape H={s.heads} dh={s.head_dim}, E={s.experts} k=1 (a choice among {s.experts} experts, "
                "one active projection per side), sigmoid expert gates on value and output",
                replicate.switchhead_fields(s, "rope", s.experts, 1), True)
    raise ValueError(f"unknown arm {arm!r}")


def model_spec(arm: str, lr: float, seed: int) -> replicate.RunSpec:
    label, fields, match = arm_fields(arm)
    return replicate.RunSpec(name=f"{arm}-{replicate_cpu.lr_tag(lr)}-s{seed}", model=f"{arm}-{replicate_cpu.lr_tag(lr)}",
                             comparison="rope", role=arm, label=f"{arm}: {label}, RoPE, lr {lr:g}", seed=seed,
                             fields=fields, match=match, training={"learning_rate": lr})


def valid_perplexity(record: dict) -> float:
    return record["perplexity"]["valid"]["perplexity"]


def test_nll(record: dict) -> float:
    """Mean test negative log-likelihood per token in nats (the log of the test perplexity)."""
    return math.log(record["perplexity"]["test"]["perplexity"])


def sweep_of(arm: str, records: dict[str, dict]) -> tuple[list[float], float | None]:
    """(the lrs of `arm`'s seed-0 sweep in run order as far as decided now, its best lr or None while undecided).

    Best = lowest validation perplexity. A best at an edge of the sweep adds the next rung beyond it, at most
    MAX_EXTENSIONS times; the best is decided once every lr of the sweep has finished and the best is bracketed or
    the extensions are used up."""
    rungs = list(SWEEP_RUNGS)
    while True:
        scores = {}
        for rung in rungs:
            record = records.get(model_spec(arm, lr_of(rung), 0).name)
            if record is None:
                return [lr_of(r) for r in rungs], None
            scores[rung] = valid_perplexity(record)
        best = min(sorted(scores), key=scores.get)  # a tie goes to the smaller lr
        if min(rungs) < best < max(rungs) or len(rungs) - len(SWEEP_RUNGS) >= MAX_EXTENSIONS:
            return [lr_of(r) for r in rungs], lr_of(best)
        rungs.append(best + 1 if best == max(rungs) else best - 1)


def plan(records: dict[str, dict]) -> tuple[list[replicate.RunSpec], list[str]]:
    """(the runs decided so far, in order; what is not yet decided and why)."""
    runs: list[replicate.RunSpec] = []
    undecided: list[str] = []
    best: dict[str, float] = {}

    def sweep(arms: tuple[str, ...]) -> None:
        for rung in SWEEP_RUNGS:  # interleaved: every lr has each arm before the next lr
            runs.extend(model_spec(arm, lr_of(rung), 0) for arm in arms)
        for arm in arms:
            lrs, chosen = sweep_of(arm, records)
            runs.extend(model_spec(arm, lr, 0) for lr in lrs[len(SWEEP_RUNGS):])
            if chosen is None:
                undecided.append(f"{arm}: best lr (its sweep is not finished), so its seeds")
            else:
                best[arm] = chosen

    def seeds(arms: tuple[str, ...]) -> None:
        for seed in range(1, max(SEEDS[arm] for arm in arms)):
            runs.extend(model_spec(arm, best[arm], seed) for arm in arms if arm in best and seed < SEEDS[arm])

    sweep(("A", "B"))
    seeds(("A", "B"))
    sweep(("C",))
    seeds(("C",))
    return runs, undecided


def committed_records(results_dir: Path | None, stem: str = STEM) -> dict[str, dict]:
    """The runs of the committed results page `results_dir/<stem>.json` (runs an earlier machine finished) when it
    was written at this scale; none otherwise."""
    committed = results_dir / f"{stem}.json" if results_dir is not None else None
    if committed is not None and committed.is_file():
        page = json.loads(committed.read_text())
        if page.get("scale") == json.loads(json.dumps(dataclasses.asdict(SCALE))):
            return dict(page.get("runs", {}))
    return {}


def finished_records(out: Path, results_dir: Path | None = None, stem: str = STEM) -> dict[str, dict]:
    """The finished runs: those of the committed results page (runs an earlier machine finished) when it was written
    at this scale, then those of the run folders under `out`, which take precedence."""
    records = committed_records(results_dir, stem)
    records.update(replicate_cpu.finished_records(out))
    return records


# ================================================================================================ the statistic
STATISTIC = """\
## The statistic, fixed before the runs

For a comparison X − Y (A − B: do the experts help beyond the gates of the same shape? A − C: does SwitchHead beat
the gated control?), each seed s gives **delta_s = test NLL(X, s) − test NLL(Y, s)**, the mean negative
log-likelihood per token on the whole WikiText-2 test split (sliding window), i.e. the log of the perplexity ratio
(−0.01 is about 1% lower perplexity for X). Both arms at their own best lr, chosen on validation only; seeds are paired
by index over the seeds both arms have (the same seed gives the same data order). With n seeds: the mean, the sample
sd, and t-based intervals mean ± t(q, n−1) · sd / sqrt(n), for q = 0.975 (95% interval) and q = 0.95 (90%).

The smallest effect of interest is **{EFFECT} nats (1%)**. Verdict:

* **X better** ("the experts help" for A − B): the 95% interval's upper end is below 0 **and** the mean is −{EFFECT}
  or lower.
* **no difference that matters** ("the experts do not help"): the whole 90% interval lies inside ±{EFFECT}
  (equivalence, two one-sided tests at 5%).
* anything else: **inconclusive** (an interval entirely above 0 is named as such beside the verdict).

The verdict is final when both arms have all their seeds ({SA} for A and B, {SC} for C); before that it is reported
as interim. Validation loss every {EVERY} steps ({EB} validation batches of {B} x {T} tokens, the same for every
run) gives the same paired differences along the training, descriptively.
"""


def t_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (a positive integer) degrees of freedom.

    The closed forms for integer df (Abramowitz and Stegun 26.7.3 and 26.7.4), with theta = atan(t / sqrt(df)):
    odd df, (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ... up to cos^(df-3)));
    even df, sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2)). No scipy needed."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    if t < 0:
        raise ValueError("t must be >= 0")
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        total, term = 0.0, 1.0
        if df > 1:
            total = 1.0
            for j in range(1, (df - 3) // 2 + 1):  # term_j = term_{j-1} * (2j) / (2j + 1) * cos^2
                term *= 2 * j / (2 * j + 1) * cos2
                total += term
        return 2 / math.pi * (theta + sin * math.cos(theta) * total)
    total, term = 1.0, 1.0
    for j in range(1, (df - 2) // 2 + 1):  # term_j = term_{j-1} * (2j - 1) / (2j) * cos^2
        term *= (2 * j - 1) / (2 * j) * cos2
        total += term
    return sin * total


def t_quantile(q: float, df: int) -> float:
    """The q quantile (0.5 < q < 1) of Student's t with `df` degrees of freedom, by bisection on t_coverage."""
    if not 0.5 < q < 1:
        raise ValueError(f"q must be in (0.5, 1), got {q}")
    target = 2 * q - 1
    low, high = 0.0, 1.0
    while t_coverage(high, df) < target:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if t_coverage(middle, df) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def paired_statistic(deltas: list[float], effect: float = EFFECT) -> dict:
    """Mean, sd, 95% and 90% t intervals and the verdict (STATISTIC) of per-seed differences X − Y."""
    n = len(deltas)
    result: dict = dict(n=n, deltas=list(deltas), mean=sum(deltas) / n if n else None, sd=None, ci95=None, ci90=None,
                        verdict="no seeds" if n == 0 else "one seed: no interval")
    if n < 2:
        return result
    mean, sd = result["mean"], statistics.stdev(deltas)
    se = sd / math.sqrt(n)
    result.update(sd=sd, ci95=[mean - t_quantile(0.975, n - 1) * se, mean + t_quantile(0.975, n - 1) * se],
                  ci90=[mean - t_quantile(0.95, n - 1) * se, mean + t_quantile(0.95, n - 1) * se])
    if result["ci95"][1] < 0 and mean <= -effect:
        result["verdict"] = "better"
    elif -effect < result["ci90"][0] and result["ci90"][1] < effect:
        result["verdict"] = "equivalent"
    else:
        result["verdict"] = "inconclusive"
    result["above_zero"] = result["ci95"][0] > 0  # X worse than Y by the 95% interval (named, not a verdict)
    return result


VERDICT_WORDS = {
    ("A", "B"): {"better": "the experts help", "equivalent": "the experts do not help (equivalent within ±1%)",
                 "inconclusive": "inconclusive"},
    ("A", "C"): {"better": "SwitchHead beats the gated control",
                 "equivalent": "SwitchHead and the gated control are equivalent within ±1%",
                 "inconclusive": "inconclusive"},
}


def verdict_words(pair: tuple[str, str], stat: dict, vocabulary: dict = VERDICT_WORDS) -> str:
    """The verdict of `stat` in the words of `vocabulary[pair]`, with an interval above 0 named beside it."""
    words = vocabulary[pair].get(stat["verdict"], stat["verdict"])
    if stat.get("above_zero"):
        words += f" ({pair[0]} worse: the 95% interval lies above 0)"
    return words


# ================================================================================================ summary
def summarise(records: dict[str, dict]) -> dict:
    """The numbers of the results pages (also stored in the JSON)."""
    sweeps = {arm: sweep_of(arm, records) for arm in ARMS}
    best = {arm: chosen for arm, (_, chosen) in sweeps.items() if chosen is not None}
    summary: dict = {"best_lr": best, "sweep": {}, "seeds": {}, "comparisons": [], "curves": {}}
    for arm, (lrs, _) in sweeps.items():
        summary["sweep"][arm] = {replicate_cpu.lr_tag(lr): dict(valid=valid_perplexity(records[n]),
                                                                  test=records[n]["perplexity"]["test"]["perplexity"])
                                 for lr in sorted(lrs) if (n := model_spec(arm, lr, 0).name) in records}
    at_best: dict[str, dict[int, dict]] = {}
    for arm, lr in best.items():
        at_best[arm] = {seed: records[n] for seed in range(SEEDS[arm])
                        if (n := model_spec(arm, lr, seed).name) in records}
        summary["seeds"][arm] = {str(seed): dict(run=r["name"], test_nll=test_nll(r),
                                                 test_perplexity=r["perplexity"]["test"]["perplexity"],
                                                 valid_perplexity=valid_perplexity(r))
                                 for seed, r in at_best[arm].items()}
    for x, y in COMPARISONS:
        if x not in at_best or y not in at_best:
            continue
        seeds = sorted(set(at_best[x]) & set(at_best[y]))
        summary["comparisons"].append(paired_comparison(
            at_best[x], at_best[y], seeds, lambda stat: dict(
                pair=f"{x} - {y}", seeds=seeds, final=len(seeds) >= min(SEEDS[x], SEEDS[y]),
                words=verdict_words((x, y), stat))))
    for arm, runs in at_best.items():
        by_step: dict[int, list[float]] = {}
        for r in runs.values():
            for step, value in zip(r["curve"]["valid_step"], r["curve"]["valid_loss"]):
                by_step.setdefault(step, []).append(value)
        summary["curves"][arm] = {str(step): dict(n=len(v), mean_valid_loss=sum(v) / len(v))
                                  for step, v in sorted(by_step.items())}
    return summary


def paired_comparison(x_runs: dict[int, dict], y_runs: dict[int, dict], seeds: list[int], labels) -> dict:
    """STATISTIC on test NLL of X − Y over `seeds` (records of each arm by seed), then `labels(stat)` (the pair's
    names and verdict words, added in that order), then the same paired differences of validation loss at every
    step both arms evaluated (`valid_curve`, descriptive)."""
    stat = paired_statistic([test_nll(x_runs[s]) - test_nll(y_runs[s]) for s in seeds])
    stat.update(labels(stat))
    curve = []
    steps = sorted(set.intersection(*(set(runs[s]["curve"]["valid_step"]) for runs in (x_runs, y_runs)
                                      for s in seeds))) if seeds else []
    for step in steps:
        def loss(runs: dict[int, dict], seed: int) -> float:
            c = runs[seed]["curve"]
            return c["valid_loss"][c["valid_step"].index(step)]
        point = paired_statistic([loss(x_runs, s) - loss(y_runs, s) for s in seeds])
        curve.append(dict(step=step, mean=point["mean"], ci95=point["ci95"]))
    stat["valid_curve"] = curve
    return stat


# ================================================================================================ results pages
def _fmt_interval(interval: list[float] | None) -> str:
    return "-" if interval is None else f"[{interval[0]:+.4f}, {interval[1]:+.4f}]"


def arm_costs(records: dict[str, dict], arm: str) -> dict | None:
    """Parameters and attention costs of an arm (the same for every lr and seed), from any finished run of it."""
    for r in records.values():
        if r["role"] == arm:
            return dict(parameters=r["parameters"], macs=r["costs"]["attention_macs_table"],
                        memory=r["costs"]["attention_memory_table"])
    return None


def code_state(stem: str = STEM) -> dict:
    """The checkout's commit and its changes other than the grid's own results pages (benchmarks/results/<stem>*)."""
    state = replicate_cpu.git_state()
    state["dirty"] = code_state_dirty(state, stem)
    return state


def render(records: dict[str, dict], runs: list[replicate.RunSpec], undecided: list[str], failed: list[str],
           summary: dict, code: dict, written: str) -> list[str]:
    """The markdown results page (lines), from the records and the plan; no file access."""
    from switchhead.evaluation.accounting import format_count

    s = SCALE
    planned = [spec.name for spec in runs]
    not_finished = [name for name in planned if name not in records]
    done = [name for name in planned if name in records]
    complete = bool(planned) and not not_finished and not undecided
    lines = page_head("Do the experts matter beyond the gate?", STEM, "run_experts_vs_gate.sh", code, written) + [
        (f"**Complete: all {len(planned)} runs have finished.**" if complete
         else f"**Progress: {len(done)} of the {len(planned)} runs decided so far have finished**"
         + (f"; next: {', '.join(not_finished[:3])}" if not_finished else "") + "."
         + (" Not yet decided: " + "; ".join(undecided) + "." if undecided else "")), ""]
    lines += timing_lines(records, None if complete else len(not_finished), "decided but not finished",
                          " (more if a sweep extends)")
    if failed:
        lines += [f"Failed (left out after {MAX_ATTEMPTS} tries): {', '.join(failed)}.", ""]
    lines += ["## Arms", "", "Parameter-matched to A through the MLP width (d_ff). Attention MACs and memory per layer "
              f"and sequence of {s.block_size} tokens (`cost_report`, the paper's accounting).", "",
              "| arm | model | params | attn MACs/layer | attn mem/layer | seeds planned |", "|---|---|---|---|---|---|"]
    for arm in ARMS:
        costs = arm_costs(records, arm)
        lines.append(f"| {arm} | {arm_fields(arm)[0]} | "
                     + (f"{costs['parameters']:,} | {format_count(costs['macs'])} | {format_count(costs['memory'])}"
                        if costs else "- | - | -") + f" | {SEEDS[arm]} |")
    lines += ["", "A dense H=8 arm with a learned per-head constant scale (gating against rescaling) is left out: "
              "the model has no such option, and this grid does not change the model.", "",
              f"Training: {s.about}; the same {s.vocab_size}-token BPE tokenizer trained on WikiText-2 train, AdamW "
              f"(wd 0), {s.warmup_steps} warmup steps then cosine to 0, gradient clip {s.grad_clip}, dropout "
              f"{s.hidden_dropout}, checkpoints every {s.save_every} steps. Validation perplexity: the first half of "
              "WikiText-2 valid (cut at a line end); test perplexity: the whole test split; both sliding window "
              f"(context {s.block_size}, stride {s.block_size // 2}).", "",
              STATISTIC.format(EFFECT=EFFECT, SA=SEEDS["A"], SC=SEEDS["C"], EVERY=s.eval_every, EB=s.eval_batches,
                               B=s.batch_size, T=s.block_size)]

    lines += ["## Verdict", ""]
    if not summary["comparisons"]:
        lines += ["No comparison has runs at both arms' best lr yet: no verdict.", ""]
    else:
        lines += verdict_table(summary["comparisons"])

    lines += ["## Learning-rate sweep (seed 0; validation perplexity chooses)", ""] + sweep_table(ARMS, records, summary)

    lines += ["## Seeds at each arm's best lr", "", "| arm | lr | seeds | test ppl mean ± sd | test NLL per seed |",
              "|---|---|---|---|---|"]
    for arm, seeds in summary["seeds"].items():
        ppl = [v["test_perplexity"] for v in seeds.values()]
        lines.append(f"| {arm} | {summary['best_lr'][arm]:g} | {len(seeds)} of {SEEDS[arm]} | "
                     + replicate_cpu._mean_sd(ppl) + " | "
                     + ", ".join(f"s{k}: {v['test_nll']:.4f}" for k, v in sorted(seeds.items())) + " |")
    lines.append("")

    tokens_per_step = s.batch_size * s.block_size
    lines += [f"## Along the training (validation loss every {s.eval_every} steps, {s.eval_batches} batches)", ""]
    steps = sorted({int(k) for curve in summary["curves"].values() for k in curve})
    if steps:
        lines += ["| arm | " + " | ".join(f"{st * tokens_per_step / 1e6:.2f}M tok" for st in steps) + " |",
                  "|---" * (len(steps) + 1) + "|"]
        for arm, curve in summary["curves"].items():
            lines.append(f"| {arm} mean valid loss | " + " | ".join(
                f"{curve[str(st)]['mean_valid_loss']:.4f} ({curve[str(st)]['n']})" if str(st) in curve else "-"
                for st in steps) + " |")
        for c in summary["comparisons"]:
            at = {p["step"]: p for p in c["valid_curve"]}
            lines.append(f"| {c['pair']} paired | " + " | ".join(
                (f"{at[st]['mean']:+.4f}" + (f" {_fmt_interval(at[st]['ci95'])}" if at[st]["ci95"] else ""))
                if st in at else "-" for st in steps) + " |")
        lines += ["", "Arm rows: mean validation loss over the seeds at the best lr (number of seeds in brackets). "
                  "Paired rows: mean difference in validation loss by seed, with its 95% t interval (descriptive; "
                  "the verdict uses test NLL only).", ""]
    else:
        lines += ["No finished run at a best lr yet.", ""]

    lines += ["## Every finished run", ""] + finished_runs_table(records, STEM) + [
              "Not finished yet (in grid order): " + (", ".join(not_finished) or "none") + ".", ""]
    return lines


def page_head(title: str, script: str, launcher: str, code: dict, written: str) -> list[str]:
    """The first lines of a grid's results page: its title, what generated it, how to run and pause the grid."""
    commit = code["commit"][:12] + (" with uncommitted changes to " + ", ".join(code["dirty"]) if code["dirty"] else "")
    return [f"# {title} (`cpu` scale, WikiText-2)", "",
            f"Generated by `experiments/{script}.py` at commit {commit}, {written}, from the run folders "
            f"(`python experiments/{script}.py --out OUT --report-only` regenerates it). The grid runs in the "
            f"background: `experiments/{launcher} OUT` starts or resumes it (finished runs are skipped, "
            "an interrupted one continues from its checkpoint); `kill -STOP -$(cat OUT/grid.pgid)` pauses it and "
            "`kill -CONT -$(cat OUT/grid.pgid)` resumes it.", ""]


def timing_lines(records: dict[str, dict], left: int | None, which: str, caveat: str = "") -> list[str]:
    """The measured time per run and, when `left` (the runs `which`) is not None, the estimate of what is left."""
    timed = [r for r in records.values() if r.get("timing_complete") and not math.isnan(r.get("wall_seconds", math.nan))]
    if not timed:
        return []
    wall, cpu = (statistics.mean(r[k] for r in timed) / 60 for k in ("wall_seconds", "cpu_seconds"))
    return [f"Measured: the {len(timed)} run(s) timed from start to end took {wall:.0f} wall-minutes and {cpu:.0f} "
            "CPU-minutes on average (training and evaluation, 1 torch thread at nice 19 on a shared machine)."
            + (f" Estimate, not a measurement: the {left} runs {which} need about {left * wall / 60:.1f} h more at "
               f"that pace{caveat}." if left is not None else ""), ""]


def verdict_table(comparisons: list[dict], column: tuple[str, str] | None = None) -> list[str]:
    """The verdicts' table (lines); `column`: (heading, key) of an extra column after the pair."""
    extra = f" {column[0]} |" if column else ""
    lines = [f"| comparison |{extra} seeds | delta per seed (nats) | mean | sd | 95% interval | 90% interval | "
             "verdict |", "|---" * (8 + bool(column)) + "|"]
    for c in comparisons:
        lines.append(f"| {c['pair']} |" + (f" {c[column[1]]} |" if column else "")
                     + f" {c['n']} ({', '.join(f's{x}' for x in c['seeds'])}) | "
                     + ", ".join(f"{d:+.4f}" for d in c["deltas"]) + " | "
                     + (f"{c['mean']:+.4f}" if c["mean"] is not None else "-") + " | "
                     + (f"{c['sd']:.4f}" if c["sd"] is not None else "-") + f" | {_fmt_interval(c['ci95'])} | "
                     f"{_fmt_interval(c['ci90'])} | {c['words']}"
                     + ("" if c["final"] else " (interim: not every seed has finished)") + " |")
    return lines + [""]


def sweep_table(arms: tuple[str, ...], records: dict[str, dict], summary: dict) -> list[str]:
    """The seed-0 lr sweeps of `arms` (lines): validation and test perplexity at each lr, and the chosen lr."""
    all_lrs = sorted({lr for arm in arms for lr in sweep_of(arm, records)[0]})
    lines = ["| arm | " + " | ".join(f"lr {lr:g}" for lr in all_lrs) + " | chosen |", "|---" * (len(all_lrs) + 2) + "|"]
    for arm in arms:
        row = summary["sweep"].get(arm, {})
        cells = [f"{row[t]['valid']:.2f} (test {row[t]['test']:.2f})" if (t := replicate_cpu.lr_tag(lr)) in row
                 else "-" for lr in all_lrs]
        chosen = summary["best_lr"].get(arm)
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {f'{chosen:g}' if chosen else 'not yet'} |")
    return lines + ["", "Cells: validation perplexity and, in brackets, test perplexity (never used to choose).", ""]


def finished_runs_table(records: dict[str, dict], stem: str) -> list[str]:
    """The results page's table of every finished run (lines, with the note under it)."""
    lines = ["| run | code | params | valid ppl | test ppl | test NLL | s/step (median) | "
             "CPU min | wall min | routing entropy mean / min |", "|---" * 10 + "|"]
    for name, r in records.items():
        dirty = any(code_state_dirty(start, stem) for start in r["code"])
        started = r["code"][0]["commit"][:8] + ("+dirty" if dirty else "") + (
            f" (+{len(r['code']) - 1} resumes)" if len(r["code"]) > 1 else "")
        rs = r.get("routing_summary")
        complete = "" if r.get("timing_complete") else ">= "
        lines.append(f"| {name} | {started} | {r['parameters']:,} | {valid_perplexity(r):.2f} | "
                     f"{r['perplexity']['test']['perplexity']:.2f} | {test_nll(r):.4f} | "
                     f"{r['step_seconds_median']:.2f} | {complete}{r.get('cpu_seconds', math.nan) / 60:.1f} | "
                     f"{complete}{r.get('wall_seconds', math.nan) / 60:.1f} | "
                     # + 0.0: a router that sends every token to one expert has entropy -0.0 (minus a sum of
                     # zeros), which would print as -0.000
                     + (f"{rs['entropy_mean']:.3f} / {rs['entropy_min'] + 0.0:.3f}" if rs else "-") + " |")
    return lines + ["", "Code: the commit each run started from (+dirty: a start had uncommitted changes other than "
                    "the results pages; every start is in the JSON). Times: 1 torch thread at nice 19 on a shared "
                    "machine.", ""]


def code_state_dirty(start: dict, stem: str = STEM) -> list[str]:
    """A start's changed paths other than the results pages (benchmarks/results/<stem>*, rewritten by the grid)."""
    return [p for p in replicate_cpu.changes_to_code(start["dirty"])
            if not (Path(p).parent.name == "results" and Path(p).name.startswith(stem))]


def scrub(value, replacements: dict[str, str]):
    """`value` (JSON data) with every string's folder prefixes replaced by placeholders: the records keep the run
    folder and data folder of the machine that ran them, which do not belong in a committed page."""
    if isinstance(value, dict):
        return {key: scrub(item, replacements) for key, item in value.items()}
    if isinstance(value, list):
        return [scrub(item, replacements) for item in value]
    if isinstance(value, str):
        for prefix, placeholder in replacements.items():
            value = value.replace(prefix, placeholder)
    return value


def write_results(out: Path, results_dir: Path, data: str | None = None, code: dict | None = None,
                  written: str | None = None, machine: dict | None = None) -> dict:
    """Rewrite the results pages from the finished runs; `code`, `written`, `machine`: the stamp on them (default:
    the checkout's state from git, now, this machine)."""
    records = finished_records(out, results_dir)
    replicate_cpu.add_timing(out, records)
    runs, undecided = plan(records)
    summary = summarise(records)
    failed = replicate_cpu.failures(out)
    code = code_state() if code is None else code
    written = written or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = machine or {k: v for k, v in replicate.machine().items() if k != "host"}
    report = dict(scale=dataclasses.asdict(SCALE), learning_rates=[lr_of(r) for r in SWEEP_RUNGS], seeds=SEEDS,
                  effect=EFFECT, code=code, machine=machine,
                  written=written, finished=list(records),
                  planned=[spec.name for spec in runs], undecided=undecided, failed=failed, summary=summary,
                  runs=records)
    lines = render(records, runs, undecided, failed, summary, code, written)
    best = summary["best_lr"]
    curves = [r for r in records.values() if r["role"] in best and r["learning_rate"] == best[r["role"]]]
    return publish(report, lines, results_dir, STEM, out, data, curves,
                   "Validation perplexity at each arm's best lr (one line per seed)")


def publish(report: dict, lines: list[str], results_dir: Path, stem: str, out: Path, data: str | None,
            curves: list[dict], title: str) -> dict:
    """Write a grid's results pages: `report` as <stem>.json with the run and data folders and the checkout
    replaced by placeholders, the validation `curves` as <stem>.png, and `lines` as <stem>.md, keeping what is
    written below its reading marker. Returns the report as written."""
    folders = {str(out): "OUT", str(Path(data or replicate.DEFAULT_DATA).resolve()): "DATA",
               str(Path(data or replicate.DEFAULT_DATA)): "DATA", str(REPO): "REPO"}
    report = scrub(report, {k: v for k, v in sorted(folders.items(), key=lambda kv: -len(kv[0]))})
    results_dir.mkdir(parents=True, exist_ok=True)
    replicate_cpu.write_json(results_dir / f"{stem}.json", report)
    replicate_cpu.SCALE = SCALE  # its plot reads the scale's tokens per step and validation batches
    image = results_dir / f"{stem}.png"
    if replicate_cpu.plot(title, curves, image):
        lines = lines + [f"![validation curves]({image.name})", ""]
    target = results_dir / f"{stem}.md"
    kept = ""
    if target.is_file() and replicate.READING_MARKER in target.read_text():
        kept = target.read_text().split(replicate.READING_MARKER, 1)[1]
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text("\n".join(lines) + "\n" + replicate.READING_MARKER + kept)
    os.replace(temporary, target)
    return report


DOCS_BEGIN = "<!-- experts-vs-gate: generated by experiments/experts_vs_gate.py --docs; edits inside are replaced -->"
DOCS_END = "<!-- experts-vs-gate: end -->"


def docs_section(report: dict) -> str:
    """docs/results.md's section: progress and, once there is one, each comparison's interval and verdict."""
    summary = report["summary"]
    finished = sum(1 for name in report["planned"] if name in report["runs"])
    lines = [DOCS_BEGIN, "", f"Generated from `benchmarks/results/{STEM}.json` (written {report['written']}).", ""]
    by_pair = {c["pair"]: c for c in summary["comparisons"]}
    for arm, seeds in summary["seeds"].items():
        ppl = [v["test_perplexity"] for v in seeds.values()]
        lines.append(f"* {arm} ({arm_fields(arm)[0]}), lr {summary['best_lr'][arm]:g}: test perplexity "
                     f"{replicate_cpu._mean_sd(ppl)} over {len(ppl)} of {SEEDS[arm]} seeds.")
    if summary["seeds"]:
        lines.append("")
    if finished < len(report["planned"]) or report["undecided"]:
        lines += [f"**The runs are in progress: {finished} of the {len(report['planned'])} runs decided so far have "
                  "finished.** Until every seed of both arms has finished, the verdicts below are interim.", ""]
    for pair in ("A - B", "A - C"):
        c = by_pair.get(pair)
        if c is None or c["ci95"] is None:
            lines.append(f"* {pair}: no verdict yet (fewer than 2 seeds at both arms' best lr).")
            continue
        lines.append(f"* {pair} (test NLL, {c['n']} seeds): mean {c['mean']:+.4f} nats, 95% interval "
                     f"{_fmt_interval(c['ci95'])}, 90% interval {_fmt_interval(c['ci90'])}: **{c['words']}**"
                     + ("" if c["final"] else " (interim)") + ".")
    lines += ["", DOCS_END]
    return "\n".join(lines)


def update_docs(report: dict, page: Path = DOCS_PAGE) -> None:
    """Replace the generated block of `page` (which must hold both markers) with the current section."""
    text = page.read_text()
    if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1:
        raise SystemExit(f"experts_vs_gate.py: error: {page} must contain the generated block's markers once each")
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    temporary = page.with_name(f".{page.name}.tmp")
    temporary.write_text(head + docs_section(report) + tail)
    os.replace(temporary, page)


# ================================================================================================ driver
def run_grid(args) -> int:
    return grid_driver.run_grid(args, Path(__file__).resolve(), lambda: finished_records(args.out, args.results_dir),
                                plan)


def main(argv: list[str] | None = None) -> int:
    parser = grid_driver.parser(__doc__.split("\n\n")[0], REPO / "runs" / "experts-vs-gate")
    parser.add_argument("--docs", type=Path, nargs="?", const=DOCS_PAGE, default=None, metavar="PAGE",
                        help="with --report-only: also rewrite the generated section of PAGE (default "
                        "docs/results.md)")
    args = parser.parse_args(argv)
    if args.tiny:
        use_tiny()
    if (code := grid_driver.start(args, SCALE)) is not None:
        return code
    if args.list:
        return grid_driver.print_plan(finished_records(args.out, args.results_dir), plan)
    if args.report_only:
        stamp = grid_driver.committed_stamp(args.results_dir, STEM) if args.same_stamp else {}
        report = write_results(args.out, args.results_dir, args.data, **stamp)
        if args.docs is not None:
            update_docs(report, args.docs)
        return 0
    replicate.ensure_tokenizer(args.out, args.data, SCALE.vocab_size)
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
