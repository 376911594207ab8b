"""MoEUT at small scale, a first look: MoEUT against SwitchAll without shared layers and a dense Transformer, each at
MoEUT's parameter count, one seed each, on WikiText-2 at the smallest scale a 2-core CPU affords.

MoEUT (Csordas et al., NeurIPS 2024) is SwitchAll (SwitchHead attention + sigma-MoE MLP) whose layers are shared in
a group: G distinct blocks applied L / G times. Its paper reports that it slightly outperforms dense Transformers of
equal parameter count from 44M to 1B parameters. Three arms, every one with d=128, L=8, RoPE, no dropout:

    moeut      G=2 distinct blocks applied 4 times, each block with 16 attention experts (H=2, dh=32, k=2) and 64 MLP
               experts of 32 (k=8); peri-LayerNorm and the group-wide entropy regulariser (0.01 MLP, 0.001
               attention), as the paper's presets
    switchall  the same model without shared layers (8 distinct blocks, peri-LayerNorm and the entropy regulariser
               kept): a quarter of the experts per block (4 attention, 16 MLP, same k), the MLP expert count then
               trimmed to the integer whose total parameter count is nearest MoEUT's (its 8 blocks each have their
               own query/key projections and routers, which MoEUT's 2 share)
    dense      pre-LayerNorm Transformer, H=4 dh=32, its MLP width chosen for the parameter count nearest MoEUT's

Same tokens (one 8k BPE tokenizer, batch 16 x 256, STEPS steps, one data order), same lr rule (one lr for every
arm, warmup then cosine to 0; no sweep), seed 0. Validation perplexity on the first half of WikiText-2 valid and
test perplexity on the whole test split, both sliding-window (stride 128), as the `cpu` grids.

One seed per arm at this scale gives a first look, no verdict: the seed-to-seed spread of the `cpu` grids (about 1%
of test perplexity) is as large as the differences the paper reports.

The runs are the `cpu` grids' (`replicate.run_one` through `grid_driver`: child processes, resumable from
checkpoints, records and timing); this script adds the arms and the results pages.

    python experiments/moeut_first_look.py --out OUT                  # run (or resume) the three runs in order
    python experiments/moeut_first_look.py --out OUT --only switchall # one of them (two drivers can share OUT)
    python experiments/moeut_first_look.py --out OUT --report-only    # rewrite the results pages

Results: benchmarks/results/moeut_first_look.{json,md} and moeut_first_look.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experts_vs_gate as grids  # noqa: E402  (the grids' provenance, page helpers and path scrubbing)
import grid_driver  # noqa: E402  (the loop every grid shares)
import replicate  # noqa: E402  (the run machinery: run_one, parameter counting, tokenizer)
import replicate_cpu  # noqa: E402  (the run child, records, timing, plot)

REPO = replicate.REPO
STEM = "moeut_first_look"
ARMS = ("moeut", "switchall", "dense")
SPEED_PAGE = "model_moeut_full_cpu_amd-epyc_1t.md"  # bench_model.py --family moeut's results on this CPU
STEPS = 150
LEARNING_RATE = 4e-3  # the lr the `cpu` grids chose for SwitchHead at d=192 (experts_vs_gate.md), for every arm
GROUP = 2  # MoEUT's distinct blocks
MLP_K = 8  # sigma-MoE experts active per token (MoEUT and SwitchAll)
SEED = 0
SCALE = dataclasses.replace(
    replicate.SCALES["cpu"], name="moeut-cpu", d=128, layers=8, d_ff=512, heads=2, experts=16, k=2, head_dim=32,
    dense_heads=4, dense_head_dim=32, mlp_experts=64, mlp_expert_size=32, max_steps=STEPS, warmup_steps=15,
    learning_rate=LEARNING_RATE, hidden_dropout=0.0, eval_every=50, eval_batches=6, save_every=50, seeds=1,
    valid_fraction=0.5, comparisons=(), ablations=(),
    about=f"d=128, 8 layers, ~3.7M parameters (2.0M of them embeddings/output), T=256, {STEPS} steps x 16 x 256 = "
    f"{STEPS * 16 * 256 / 1e6:.2f}M tokens (0.22 epoch of the 2.84M-token training split)")


def use_tiny() -> None:
    """Tiny models and runs for the tests (seconds per run); passed on to every child with --tiny."""
    global SCALE, MLP_K
    SCALE = dataclasses.replace(replicate.SCALES["smoke"], name="moeut-tiny", layers=4, heads=2, head_dim=8,
                                experts=4, k=2, mlp_experts=8, mlp_expert_size=8, dense_heads=2, dense_head_dim=16,
                                max_steps=6, warmup_steps=1, save_every=3, eval_every=3, eval_batches=1, seeds=1,
                                learning_rate=2e-3, about="tiny (tests)")
    MLP_K = 2


# ================================================================================================ the arms
def _common() -> dict:
    s = SCALE
    return dict(hidden_size=s.d, num_hidden_layers=s.layers, max_position_embeddings=s.block_size,
                position_encoding="rope", xl_memory_length=0, hidden_dropout=s.hidden_dropout, attention_dropout=0.0,
                attention_expert_dropout=0.0)


def _moeut_fields() -> dict:
    s = SCALE
    return {**_common(), "attention_type": "switchhead", "num_attention_heads": s.heads, "head_dim": s.head_dim,
            "num_attention_experts": s.experts, "num_attention_experts_per_tok": s.k, "mlp_type": "sigma_moe",
            "num_mlp_experts": s.mlp_experts, "mlp_expert_size": s.mlp_expert_size,
            "num_mlp_experts_per_tok": MLP_K, "layer_group_size": GROUP, "layernorm_placement": "peri",
            "entropy_reg_scope": "group", "entropy_reg_coef": 0.01, "attention_entropy_reg_coef": 0.001}


def arm_fields(arm: str) -> tuple[str, dict]:
    """(description, SwitchHeadConfig fields without the vocabulary), parameter-matched to the MoEUT arm."""
    s = SCALE
    moeut = _moeut_fields()
    repeats = s.layers // GROUP
    target = replicate.count_parameters(moeut, s.vocab_size)
    if arm == "moeut":
        return (f"MoEUT: G={GROUP} blocks x {repeats}, attention H={s.heads} dh={s.head_dim} E={s.experts} "
                f"k={s.k}, MLP {s.mlp_experts}x{s.mlp_expert_size} k={MLP_K}, peri-LayerNorm", moeut)
    if arm == "switchall":
        fields = {**moeut, "layer_group_size": None, "num_attention_experts": s.experts // repeats}
        counts = {n: replicate.count_parameters({**fields, "num_mlp_experts": n}, s.vocab_size)
                  for n in range(max(MLP_K, s.mlp_experts // repeats - 4), s.mlp_experts // repeats + 1)}
        fields["num_mlp_experts"] = min(counts, key=lambda n: (abs(counts[n] - target), -n))
        return (f"SwitchAll: {s.layers} distinct blocks, attention H={s.heads} dh={s.head_dim} "
                f"E={fields['num_attention_experts']} k={s.k}, MLP {fields['num_mlp_experts']}x{s.mlp_expert_size} "
                f"k={MLP_K}, peri-LayerNorm", fields)
    if arm == "dense":
        fields = {**_common(), "attention_type": "dense", "num_attention_heads": s.dense_heads,
                  "head_dim": s.dense_head_dim, "mlp_type": "dense", "intermediate_size": s.d_ff}
        fields = replicate.match_parameters(fields, target, s.vocab_size)[0]
        return (f"dense: {s.layers} layers, H={s.dense_heads} dh={s.dense_head_dim}, MLP "
                f"{fields['intermediate_size']}, pre-LayerNorm", fields)
    raise ValueError(f"unknown arm {arm!r}")


def model_spec(arm: str) -> replicate.RunSpec:
    label, fields = arm_fields(arm)
    return replicate.RunSpec(name=f"{arm}-s{SEED}", model=arm, comparison="moeut", role=arm, label=label, seed=SEED,
                             fields=fields, match=False, training={"learning_rate": SCALE.learning_rate})


def plan(records: dict[str, dict]) -> tuple[list[replicate.RunSpec], list[str]]:
    return [model_spec(arm) for arm in ARMS], []


def finished_records(out: Path, results_dir: Path | None = None) -> dict[str, dict]:
    """The committed page's runs when it was written at this scale, then the run folders' (which take precedence)."""
    records = {}
    committed = results_dir / f"{STEM}.json" if results_dir is not None else None
    if committed is not None and committed.is_file():
        page = json.loads(committed.read_text())
        if page.get("scale") == json.loads(json.dumps(dataclasses.asdict(SCALE))):
            records.update(page.get("runs", {}))
    records.update(replicate_cpu.finished_records(out))
    return records


# ================================================================================================ results
def embedding_parameters(record: dict) -> int:
    """The input embedding and output layer's parameters (one matrix when they are tied)."""
    vocab = record["training_settings"]["vocab_size"]
    tied = record["fields"].get("tie_word_embeddings", False)
    return vocab * record["fields"]["hidden_size"] * (1 if tied else 2)


def summarise(records: dict[str, dict]) -> dict:
    rows = {}
    for arm in ARMS:
        record = records.get(model_spec(arm).name)
        if record is None:
            continue
        macs = record["costs"]["model_forward_macs"]
        rows[arm] = dict(label=record["label"], parameters=record["parameters"],
                         non_embedding_parameters=record["parameters"] - embedding_parameters(record),
                         macs_per_token=macs["per_token"],
                         macs_per_token_without_lm_head=(macs["total"] - macs["lm_head"]) / SCALE.block_size,
                         valid_perplexity=record["perplexity"]["valid"]["perplexity"],
                         test_perplexity=record["perplexity"]["test"]["perplexity"],
                         final_train_loss=record["train"].get("final_loss"),
                         step_seconds_median=record.get("step_seconds_median"),
                         wall_seconds=record.get("wall_seconds"))
    return rows


LIMITS = """\
## What one seed each can and cannot say

* It **can** say that the three models train on the same tokens with the same lr rule to perplexities of the size
  above, with the parameters and forward MACs listed, and that MoEUT's shared layers run through the package's
  training, checkpointing and evaluation end to end on a CPU.
* It **cannot** rank the arms. One seed per arm: the `cpu` grids' seed-to-seed spread of test perplexity is about
  1% (sd 0.3-0.4 at perplexity ~45, [experts_vs_gate.md](experts_vs_gate.md)), as large as the gains the MoEUT
  paper reports over dense models. A difference here smaller than a few percent is not a finding, and a larger one
  may still come from the one lr suiting the arms unequally, not from the architecture.
* It **cannot** stand for the paper's claim: the scale is tiny (about {NONEMB} non-embedding parameters next to the
  paper's 44M-1B), the run is short ({TOKENS} tokens, under a third of an epoch of WikiText-2 where the paper trains
  on billions of C4 / peS2o / The Stack tokens), the lr is one value for every arm, not each arm's best (the arms
  may prefer different lrs: MoEUT's shared blocks get {REPEATS}x the gradient updates per parameter), and the
  models are under-trained, where the ranking of architectures can change with more tokens.
* The verdict a comparison needs (several seeds, each arm at its own best lr, a paired interval against a smallest
  effect of interest, as [experts_vs_gate.md](experts_vs_gate.md)) is not attempted here.
"""


def render(records: dict[str, dict], summary: dict, code: dict, written: str, machine: dict) -> list[str]:
    from switchhead.evaluation.accounting import format_count

    s = SCALE
    commit = code["commit"][:12] + (" with uncommitted changes to " + ", ".join(code["dirty"]) if code["dirty"] else "")
    done = [arm for arm in ARMS if arm in summary]
    lines = ["# MoEUT at small scale: a first look (WikiText-2, one seed each)", "",
             f"Generated by `experiments/{STEM}.py` at commit {commit}, {written}, from the run folders "
             f"(`python experiments/{STEM}.py --out OUT --report-only` regenerates it).", "",
             f"Machine: {machine['device']} ({machine.get('threads')} torch thread per run, "
             f"{machine.get('cores', '?')} cores shared with other jobs), Python {machine['python']}, torch "
             f"{machine['torch']}, transformers {machine['transformers']}.",
             ""]
    started = sorted({start["commit"][:12] for r in records.values() for start in r.get("code", [])})
    if started:
        lines += [f"The runs ran at commit(s) {', '.join(started)} (each start's commit and changes: the JSON).", ""]
    lines += [("**Complete: all three runs have finished.**" if len(done) == len(ARMS)
                  else f"**Progress: {len(done)} of {len(ARMS)} runs finished.**"), ""]
    timed = [r for r in records.values() if r.get("timing_complete")]
    if timed:
        lines += [f"Measured: the {len(timed)} timed run(s) took {min(r['wall_seconds'] for r in timed) / 60:.0f}-"
                  f"{max(r['wall_seconds'] for r in timed) / 60:.0f} wall-minutes each (training and evaluation, 1 "
                  "torch thread, two runs at a time beside other jobs).", ""]
    lines += ["## Arms", "",
              "MoEUT (Csordás, Irie, Schmidhuber, Potts, Manning, NeurIPS 2024, arXiv 2405.16039) is SwitchAll with "
              "shared layers. Every arm: d=128, 8 layers (applications), RoPE, no dropout, 8k BPE vocabulary "
              "(untied input and output embeddings: 2.05M parameters of each arm). SwitchAll and dense are "
              "parameter-matched to MoEUT (SwitchAll through its MLP expert count, dense through its MLP width).", "",
              "| arm | model | parameters | non-embedding | MACs / token | MACs / token without the output layer |",
              "|---|---|---|---|---|---|"]
    for arm in ARMS:
        label = arm_fields(arm)[0]
        if arm in summary:
            r = summary[arm]
            lines.append(f"| {arm} | {label} | {r['parameters']:,} | {r['non_embedding_parameters']:,} | "
                         f"{format_count(r['macs_per_token'])} | {format_count(r['macs_per_token_without_lm_head'])} |")
        else:
            lines.append(f"| {arm} | {label} | - | - | - | - |")
    lines += ["", "MACs: the forward pass per token at context 256 (`cost_report`, the package's accounting: every "
              "one of the 8 applications counted, active experts only, attention at its average context).", "",
              f"Training: {s.about}; AdamW, lr {s.learning_rate:g} for every arm, {s.warmup_steps} warmup steps then "
              f"cosine to 0, gradient clipping {s.grad_clip}, seed {SEED} (same initialisation seed and data order "
              "for every arm). Perplexity: sliding window (context 256, stride 128) on the first half of WikiText-2 "
              "valid and the whole test split.", "",
              "## Results", "", "| arm | valid perplexity | test perplexity | test vs MoEUT | median step (s) |",
              "|---|---|---|---|---|"]
    base = summary.get("moeut", {}).get("test_perplexity")
    for arm in ARMS:
        if arm not in summary:
            lines.append(f"| {arm} | - | - | - | - |")
            continue
        r = summary[arm]
        ratio = f"{r['test_perplexity'] / base - 1:+.1%}" if base and arm != "moeut" else "-"
        step = f"{r['step_seconds_median']:.2f}" if r["step_seconds_median"] else "-"
        lines.append(f"| {arm} | {r['valid_perplexity']:.2f} | {r['test_perplexity']:.2f} | {ratio} | {step} |")
    lines += ["", "Step times are the trainer's median on a shared 2-core machine (other jobs running), not a speed "
              "comparison; the CPU speed ratios of the 44M models are measured interleaved in "
              f"[{SPEED_PAGE}]({SPEED_PAGE}).", ""]
    nonemb = summary.get("moeut", {}).get("non_embedding_parameters")
    lines.append(LIMITS.format(NONEMB=format_count(nonemb) if nonemb else "1.7M",
                               TOKENS=f"{s.tokens / 1e6:.2f}M", REPEATS=s.layers // GROUP))
    return lines


def write_results(out: Path, results_dir: Path, data: str | None = None, code: dict | None = None,
                  written: str | None = None, machine: dict | None = None) -> dict:
    """Rewrite the results pages from the finished runs; `code`, `written`, `machine`: the stamp on them (default:
    the checkout's state from git, now, this machine as benchmarks/machine.py names it)."""
    records = finished_records(out, results_dir)
    replicate_cpu.add_timing(out, records)
    summary = summarise(records)
    code = grids.code_state(STEM) if code is None else code
    written = written or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if machine is None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import torch
        from machine import describe

        machine = {k: v for k, v in describe(torch.device("cpu")).items() if k != "machine"}
        machine.update(threads=1, cores=os.cpu_count())  # each run's torch threads (set by the runs)
    report = dict(scale=dataclasses.asdict(SCALE), group=GROUP, mlp_k=MLP_K, code=code, machine=machine,
                  written=written, summary=summary, runs=records)
    lines = render(records, summary, code, written, machine)
    folders = {str(out): "OUT", str(Path(data or replicate.DEFAULT_DATA).resolve()): "DATA",
               str(Path(data or replicate.DEFAULT_DATA)): "DATA", str(REPO): "REPO"}
    report = grids.scrub(report, dict(sorted(folders.items(), key=lambda kv: -len(kv[0]))))
    results_dir.mkdir(parents=True, exist_ok=True)
    replicate_cpu.write_json(results_dir / f"{STEM}.json", report)
    replicate_cpu.SCALE = SCALE  # its plot reads the tokens per step and validation batches
    image = results_dir / f"{STEM}.png"
    if replicate_cpu.plot("MoEUT vs SwitchAll vs dense at equal parameters (seed 0)", list(records.values()), image):
        lines += [f"![validation curves]({image.name})", ""]
    target = results_dir / f"{STEM}.md"
    kept = target.read_text().split(replicate.READING_MARKER, 1)[1] if (
        target.is_file() and replicate.READING_MARKER in target.read_text()) else ""
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text("\n".join(lines) + "\n" + replicate.READING_MARKER + kept)
    os.replace(temporary, target)
    return report


# ================================================================================================ driver
def main(argv: list[str] | None = None) -> int:
    args = grid_driver.parser(__doc__.split("\n\n")[0], REPO / "runs" / "moeut-first-look").parse_args(argv)
    if args.tiny:
        use_tiny()
    if (code := grid_driver.start(args, SCALE)) is not None:
        return code
    if args.list:
        return grid_driver.print_plan(finished_records(args.out, args.results_dir), plan)
    if args.report_only:
        stamp = grid_driver.committed_stamp(args.results_dir, STEM) if args.same_stamp else {}
        write_results(args.out, args.results_dir, args.data, **stamp)
        return 0
    replicate.ensure_tokenizer(args.out, args.data, SCALE.vocab_size)
    return grid_driver.run_grid(args, Path(__file__).resolve(),
                                lambda: finished_records(args.out, args.results_dir), plan)


if __name__ == "__main__":
    sys.exit(main())
