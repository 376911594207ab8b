"""Replicate the paper's central claim with our own training runs.

SwitchHead (MoE value/output projections, few heads) against two parameter-matched dense baselines, trained on
WikiText-2 with one 8k BPE tokenizer and the same token budget, optimiser and schedule:

    (a) SwitchHead, RoPE and Transformer-XL positions
    (b) dense attention with SwitchHead's total number of heads (H x E), parameter-matched (the paper's baseline)
    (c) dense attention with SwitchHead's number of active heads (H), parameter-matched
    (d) SwitchAll (SwitchHead attention + sigma-MoE MLP)
    (e) ablations of SwitchHead: k, E (E = 1 is dense attention with a per-head output gate), value-only and
        output-only experts (`attention_expert_projections`)
    (f) a sweep (seed 0): learning rate and token budget of SwitchHead, the same-total-heads baseline and the gated
        control, to see whether the ranking at the grid's own settings is one of tuning

Every run is `switchhead.training.train` into its own folder, then `switchhead.evaluation` on the saved model:
validation and test perplexity (`evaluate_perplexity`, the same protocol for every model), zero-shot BLiMP and
LAMBADA (the package's lm-eval tasks, `run_lm_eval`), attention MACs / memory per layer (`cost_report`, what
`switchhead flops` prints). Each run is a subprocess of its own (so the peak memory it reports is its own); a
finished run leaves `run.json` in its folder and is skipped next time; an interrupted run resumes from its
latest checkpoint. After every run the results files are rewritten from all finished runs.

    python experiments/replicate.py --scale small --out RUNS                 # the grid of benchmarks/results
    python experiments/replicate.py --scale cpu                              # the cpu shapes; the cpu grid runs them
                                                                            # with replicate_cpu.py (its own order)
    python experiments/replicate.py --scale gpu                              # the paper's 45M/47M sizes
    python experiments/replicate.py --smoke --out runs/smoke --results-dir runs/smoke/results
    python experiments/replicate.py --scale small --report-only              # rewrite the results files

Results: `<results-dir>/replication.json` (every run: settings, parameters, costs, curves, numbers),
`replication.md` (tables), `replication_<comparison>.png` (loss curves).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the test data folder: $SWITCHHEAD_DATA_DIR (which the evaluation tasks read too), else ../shared/data
DATA_ROOT = Path(os.environ.get("SWITCHHEAD_DATA_DIR") or REPO.parent / "shared" / "data").expanduser()
DEFAULT_DATA = str(DATA_ROOT / "wikitext-2")
RESULTS_DIR = REPO / "benchmarks" / "results"
BLIMP_DIR = DATA_ROOT / "blimp"
RUN_RECORD = "run.json"
READING_MARKER = "<!-- reading: hand-written below this line, kept when the tables above are regenerated -->"


# ================================================================================================ scales
@dataclasses.dataclass
class Scale:
    """Model sizes, token budget and evaluation settings of one grid."""

    name: str
    about: str
    d: int
    layers: int
    d_ff: int  # of SwitchHead; the dense baselines get theirs from parameter matching
    heads: int  # SwitchHead heads H
    experts: int  # E
    k: int
    head_dim: int  # SwitchHead dh
    dense_heads: int  # (b): H x E
    dense_head_dim: int  # (b); (c) keeps H x dh of (b): dh = dense_heads * dense_head_dim / heads
    mlp_experts: int  # SwitchAll's sigma-MoE
    mlp_expert_size: int
    block_size: int
    batch_size: int
    max_steps: int
    warmup_steps: int
    learning_rate: float
    grad_clip: float
    hidden_dropout: float
    vocab_size: int
    seeds: int
    eval_every: int
    eval_batches: int
    save_every: int
    blimp_pairs: int | None  # pairs per BLiMP paradigm (None: all 1,000)
    lambada_passages: int | None  # first N LAMBADA passages (None: all 5,153)
    blimp_paradigms: int | None = None  # first N paradigms in sorted order (None: all 67)
    entropy_reg_coef: float = 0.0001
    comparisons: tuple[str, ...] = ("rope", "xl", "switchall", "ablation")
    # (tag, E, k); E = 1: SwitchHead with one expert per head (dense + output gate); tag "gate": the
    # same-total-heads dense baseline with that output gate; tags "Vonly" / "Oonly": experts on one side only
    ablations: tuple[tuple[str, int, int], ...] = (("k1", 5, 1), ("k3", 5, 3), ("E1", 1, 1), ("E3", 3, 2),
                                                   ("E8", 8, 2), ("gate", 1, 1))
    perplexity_protocol: str = "sliding"  # stride block_size // 2
    seeded_ablations: tuple[str, ...] = ()  # ablation tags that also get seeds 1 .. seeds-1 (after the others)
    valid_fraction: float = 1.0  # validation perplexity on this leading share of the split (test: always all)
    zero_shot_seeds: int = 3  # zero-shot evaluation only for the runs of seeds below this
    eval_batch_size: int = 16
    # (f): (tag, training overrides) x models ("switchhead", "dense-total", "gate"), seed 0, RoPE
    sweeps: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    sweep_models: tuple[str, ...] = ("switchhead", "dense-total", "gate")
    seeded_sweeps: tuple[str, ...] = ()  # sweep tags that also get seeds 1 .. seeds-1 (after all seed-0 runs)
    sweep_ablations: tuple[tuple[str, str], ...] = ()  # (sweep tag, ablation tag): an ablation at that setting, last

    @property
    def tokens(self) -> int:
        return self.max_steps * self.batch_size * self.block_size


SCALES = {
    # the grid of benchmarks/results/replication.md: 1 torch thread on a 2-core machine shared with other jobs
    "small": Scale("small", "d=128, 4 layers, ~2.9M parameters (2.1M of them embeddings/output), T=256, "
                     "160 steps x 8 x 256 = 328K tokens (0.12 epoch of WikiText-2)",
                     d=128, layers=4, d_ff=512, heads=2, experts=5, k=2, head_dim=24, dense_heads=8,
                     dense_head_dim=16, mlp_experts=16, mlp_expert_size=32, block_size=256, batch_size=8,
                     max_steps=160, warmup_steps=16, learning_rate=2e-3, grad_clip=0.25, hidden_dropout=0.0,
                     vocab_size=8000, seeds=3, eval_every=20, eval_batches=8, save_every=40, blimp_pairs=10,
                     lambada_passages=200, valid_fraction=0.25, perplexity_protocol="chunked", zero_shot_seeds=1,
                     ablations=(("E1", 1, 1), ("k1", 5, 1), ("gate", 1, 1), ("k3", 5, 3), ("E8", 8, 2),
                                ("E3", 3, 2), ("Vonly", 5, 2), ("Oonly", 5, 2)),
                     seeded_ablations=("gate", "Vonly", "Oonly"),
                     comparisons=("rope", "xl", "switchall", "ablation", "sweep"),
                     sweeps=(("lr1e-3", (("learning_rate", 1e-3),)), ("lr4e-3", (("learning_rate", 4e-3),)),
                             ("lr8e-3", (("learning_rate", 8e-3),)), ("lr16e-3", (("learning_rate", 1.6e-2),)),
                             ("tokens2x", (("max_steps", 320), ("warmup_steps", 32)))),
                     seeded_sweeps=("lr8e-3",), sweep_ablations=(("lr8e-3", "Vonly"), ("lr8e-3", "Oonly"))),
    # the size the cpu grid was planned at: about 10 minutes per run with 2 threads on 2 CPU cores
    "cpu": Scale("cpu", "d=192, 6 layers, ~5M parameters, T=256, 1200 steps x 16 x 256 = 4.9M tokens (~2 epochs)",
                 d=192, layers=6, d_ff=768, heads=2, experts=5, k=2, head_dim=32, dense_heads=8, dense_head_dim=24,
                 mlp_experts=16, mlp_expert_size=48, block_size=256, batch_size=16, max_steps=1200,
                 warmup_steps=100, learning_rate=1e-3, grad_clip=0.25, hidden_dropout=0.1, vocab_size=8000,
                 seeds=3, eval_every=200, eval_batches=20, save_every=200, blimp_pairs=100, lambada_passages=1000),
    # the paper's WT103 47M shapes (PAPER.md section 4), on WikiText-2; for a GPU
    "gpu": Scale("gpu", "the paper's 47M shapes (d=412, 16 layers, H=2, E=5, k=2, dh=76; dense 10 x 41), T=256, "
                 "20k steps x 64 x 256 = 328M tokens", d=412, layers=16, d_ff=2080, heads=2, experts=5, k=2,
                 head_dim=76, dense_heads=10, dense_head_dim=41, mlp_experts=16, mlp_expert_size=128,
                 block_size=256, batch_size=64, max_steps=20_000, warmup_steps=0, learning_rate=2.5e-4,
                 grad_clip=0.1, hidden_dropout=0.1, vocab_size=8000, seeds=3, eval_every=1000, eval_batches=50,
                 save_every=1000, blimp_pairs=None, lambada_passages=None),
    # the CI smoke test: two tiny models, a few steps, one seed
    "smoke": Scale("smoke", "two tiny models, 3 steps (context 128: lm-eval needs room for a BLiMP sentence)", d=32, layers=1, d_ff=64, heads=2, experts=4, k=2,
                   head_dim=8, dense_heads=8, dense_head_dim=4, mlp_experts=4, mlp_expert_size=16, block_size=128,
                   batch_size=2, max_steps=3, warmup_steps=1, learning_rate=2e-3, grad_clip=0.25,
                   hidden_dropout=0.0, vocab_size=1000, seeds=1, eval_every=2, eval_batches=2, save_every=2,
                   blimp_pairs=2, lambada_passages=3, blimp_paradigms=2, comparisons=("rope",), ablations=(),
                   perplexity_protocol="chunked", eval_batch_size=8),
}

COMPARISON_TITLES = {
    "rope": "SwitchHead vs dense baselines, RoPE",
    "xl": "SwitchHead vs dense baselines, Transformer-XL",
    "switchall": "SwitchAll vs SwitchHead and dense (RoPE)",
    "ablation": "SwitchHead ablations (RoPE): k, E, value-only / output-only experts",
    "sweep": "Learning rate and token budget (RoPE, seed 0)",
}
EXPERT_SIDES = {"Vonly": "value", "Oonly": "output"}  # ablation tag -> attention_expert_projections


# ================================================================================================ the grid
@dataclasses.dataclass
class RunSpec:
    name: str  # folder name, e.g. rope-switchhead-s0
    model: str  # model name without seed, e.g. rope-switchhead
    comparison: str
    role: str  # "switchhead", "dense-total", "dense-active", "switchall", "ablation"
    label: str  # for tables and plots
    seed: int
    fields: dict  # SwitchHeadConfig fields (before parameter matching and vocabulary)
    match: bool  # adjust intermediate_size to SwitchHead's parameter count
    training: dict = dataclasses.field(default_factory=dict)  # TrainingConfig overrides (the sweep)


def _base_fields(scale: Scale, position: str) -> dict:
    return dict(hidden_size=scale.d, num_hidden_layers=scale.layers, intermediate_size=scale.d_ff,
                max_position_embeddings=scale.block_size, position_encoding=position,
                xl_memory_length=scale.block_size if position == "xl" else 0, hidden_dropout=scale.hidden_dropout,
                attention_dropout=0.0, attention_expert_dropout=0.0, mlp_type="dense")


def switchhead_fields(scale: Scale, position: str, experts: int | None = None, k: int | None = None,
                      sides: str = "value_output") -> dict:
    fields = {**_base_fields(scale, position), "attention_type": "switchhead", "num_attention_heads": scale.heads,
              "head_dim": scale.head_dim, "num_attention_experts": experts or scale.experts,
              "num_attention_experts_per_tok": k or scale.k}
    if sides != "value_output":  # the default is left out, so the grid's earlier runs keep their fields
        fields["attention_expert_projections"] = sides
    return fields


def dense_fields(scale: Scale, position: str, heads: int, head_dim: int, gate: bool = False) -> dict:
    return {**_base_fields(scale, position), "attention_type": "dense", "num_attention_heads": heads,
            "head_dim": head_dim, "attention_output_gate": gate}


def plan(scale: Scale) -> list[RunSpec]:
    """Every run of the grid, most important first (so that a cut-off grid still answers the main question)."""
    active_head_dim = scale.dense_heads * scale.dense_head_dim // scale.heads

    def triple(position: str, seed: int) -> list[RunSpec]:
        p = position
        kinds = [
            ("switchhead", f"SwitchHead H={scale.heads} E={scale.experts} k={scale.k} dh={scale.head_dim}",
             switchhead_fields(scale, p), False),
            ("dense-total", f"dense H={scale.dense_heads} dh={scale.dense_head_dim} (same total heads)",
             dense_fields(scale, p, scale.dense_heads, scale.dense_head_dim), True),
            ("dense-active", f"dense H={scale.heads} dh={active_head_dim} (same active heads)",
             dense_fields(scale, p, scale.heads, active_head_dim), True),
        ]
        if scale.name == "smoke":
            kinds = kinds[:2]
        return [RunSpec(f"{p}-{role}-s{seed}", f"{p}-{role}", p, role, f"{label}, {p.upper() if p == 'xl' else 'RoPE'}",
                        seed, fields, match) for role, label, fields, match in kinds]

    runs: list[RunSpec] = []
    if "rope" in scale.comparisons:
        for seed in range(scale.seeds):
            runs += triple("rope", seed)
    if "switchall" in scale.comparisons:
        fields = {**switchhead_fields(scale, "rope"), "mlp_type": "sigma_moe", "num_mlp_experts": scale.mlp_experts,
                  "mlp_expert_size": scale.mlp_expert_size, "num_mlp_experts_per_tok": 4,
                  "entropy_reg_coef": scale.entropy_reg_coef}
        runs.append(RunSpec("rope-switchall-s0", "rope-switchall", "switchall", "switchall",
                            f"SwitchAll (sigma-MoE MLP {scale.mlp_experts}x{scale.mlp_expert_size}, k=4), RoPE",
                            0, fields, False))
    ablations: list[RunSpec] = []
    if "ablation" in scale.comparisons:
        for tag, experts, k in scale.ablations:
            if tag == "gate":  # the same-total-heads dense baseline with SwitchHead's per-head sigmoid output gate
                fields = dense_fields(scale, "rope", scale.dense_heads, scale.dense_head_dim, gate=True)
                label = f"dense H={scale.dense_heads} dh={scale.dense_head_dim} + output gate, RoPE"
            elif tag in EXPERT_SIDES:  # SwitchHead with experts on one side, a dense ungated projection on the other
                fields = switchhead_fields(scale, "rope", experts, k, sides=EXPERT_SIDES[tag])
                label = (f"SwitchHead {'value' if tag == 'Vonly' else 'output'} experts only "
                         f"(dense {'O' if tag == 'Vonly' else 'V'}), RoPE")
            elif experts == 1:  # SwitchHead with one expert per head: dense attention with a per-head output gate
                fields = dense_fields(scale, "rope", scale.heads, scale.head_dim, gate=True)
                label = f"E=1 (dense H={scale.heads} dh={scale.head_dim} + output gate), RoPE"
            else:
                fields = switchhead_fields(scale, "rope", experts, k)
                label = f"SwitchHead E={experts} k={k}, RoPE"
            ablations.append(RunSpec(f"rope-ablation-{tag}-s0", f"rope-ablation-{tag}", "ablation", "ablation", label,
                                     0, fields, True))
    seeded = [dataclasses.replace(spec, name=spec.name[:-1] + str(seed), seed=seed)
              for spec in ablations if spec.name[len("rope-ablation-"):-3] in scale.seeded_ablations
              for seed in range(1, scale.seeds)]
    # priority: the first two ablations, then one seed of XL, then the other ablations, then XL's other seeds
    runs += ablations[:2]
    if "xl" in scale.comparisons:
        runs += triple("xl", 0)
    runs += ablations[2:] + seeded
    if "xl" in scale.comparisons:
        for seed in range(1, scale.seeds):
            runs += triple("xl", seed)
    if "sweep" in scale.comparisons:
        bases = {spec.role: spec for spec in triple("rope", 0)}
        bases.update({"gate": spec for spec in ablations if spec.name == "rope-ablation-gate-s0"})
        sweep = [RunSpec(f"rope-sweep-{tag}-{role}-s0", f"rope-sweep-{tag}-{role}", "sweep", "sweep",
                         f"{bases[role].label}, {sweep_title(tag, dict(overrides), scale)}", 0, bases[role].fields,
                         bases[role].match, dict(overrides))
                 for tag, overrides in scale.sweeps for role in scale.sweep_models if role in bases]
        runs += sweep
        runs += [dataclasses.replace(spec, name=spec.name[:-1] + str(seed), seed=seed)
                 for seed in range(1, scale.seeds) for spec in sweep
                 if any(spec.model.startswith(f"rope-sweep-{tag}-") for tag in scale.seeded_sweeps)]
        overrides_of = dict(scale.sweeps)
        for tag, ablation in scale.sweep_ablations:
            base = next((spec for spec in ablations if spec.name == f"rope-ablation-{ablation}-s0"), None)
            if base is not None and tag in overrides_of:
                runs.append(RunSpec(f"rope-sweep-{tag}-{ablation}-s0", f"rope-sweep-{tag}-{ablation}", "sweep",
                                    "sweep", f"{base.label}, {sweep_title(tag, dict(overrides_of[tag]), scale)}", 0,
                                    base.fields, base.match, dict(overrides_of[tag])))
    return runs


def sweep_title(tag: str, overrides: dict, scale: Scale) -> str:
    parts = []
    if "learning_rate" in overrides:
        parts.append(f"lr {overrides['learning_rate']:g}")
    if "max_steps" in overrides:
        parts.append(f"{overrides['max_steps'] / scale.max_steps:g}x tokens")
    return ", ".join(parts) or tag


# ================================================================================================ parameter matching
def count_parameters(fields: dict, vocab_size: int) -> int:
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    with torch.device("meta"):
        return SwitchHeadForCausalLM(SwitchHeadConfig(vocab_size=vocab_size, **fields)).num_parameters()


def match_parameters(fields: dict, target: int, vocab_size: int) -> tuple[dict, int]:
    """`fields` with `intermediate_size` chosen so that the parameter count is closest to `target`.

    The dense MLP has 2*d*d_ff + d_ff + d parameters per layer, so the count is linear in d_ff: one step solves it,
    the neighbours are checked for rounding."""
    if fields.get("mlp_type", "dense") != "dense":
        raise ValueError("parameter matching adjusts the dense MLP's intermediate_size")
    per_unit = fields["num_hidden_layers"] * (2 * fields["hidden_size"] + 1)
    now = count_parameters(fields, vocab_size)
    guess = fields["intermediate_size"] + round((target - now) / per_unit)
    best = min((max(1, guess + delta) for delta in (-1, 0, 1)),
               key=lambda d_ff: abs(count_parameters({**fields, "intermediate_size": d_ff}, vocab_size) - target))
    matched = {**fields, "intermediate_size": best}
    return matched, count_parameters(matched, vocab_size)


def resolved_fields(spec: RunSpec, scale: Scale, vocab_size: int) -> dict:
    if not spec.match:
        return dict(spec.fields)
    target = count_parameters(switchhead_fields(scale, spec.fields["position_encoding"]), vocab_size)
    return match_parameters(spec.fields, target, vocab_size)[0]


# ================================================================================================ data and tokenizer
def split_file(data: str, split: str) -> str:
    path = os.path.join(data, f"wiki.{split}.tokens")
    if not os.path.isfile(path):
        raise SystemExit(f"replicate.py: error: {path} does not exist (--data must be a WikiText folder)")
    return path


def ensure_tokenizer(out: Path, data: str, vocab_size: int) -> Path:
    """One BPE tokenizer for every run, trained once on the training split (switchhead.training's trainer)."""
    from switchhead.training import load_documents, train_tokenizer

    folder = out / "tokenizer"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    train_documents, _ = load_documents(data)
    tokenizer = train_tokenizer(train_documents, vocab_size)
    temporary = out / ".tokenizer-tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    tokenizer.save_pretrained(str(temporary))
    os.replace(temporary, folder)
    return folder


# ================================================================================================ one run
def _read_log(run_dir: Path) -> list[dict]:
    import csv

    with open(run_dir / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def run_one(spec: RunSpec, scale: Scale, out: Path, data: str, tokenizer_dir: Path, zero_shot: bool) -> dict:
    """Train (or resume), evaluate and record one run; returns its record (also written to RUN_RECORD)."""
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.evaluation import cost_report
    from switchhead.evaluation.perplexity import evaluate_perplexity, read_text
    from switchhead.training import TrainingConfig, checkpoint_dirs, load_tokenizer, train

    run_dir = out / spec.name
    tokenizer = load_tokenizer(str(tokenizer_dir))
    vocab_size = len(tokenizer)
    fields = resolved_fields(spec, scale, vocab_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # ------------------------------------------------------------------ training (resumable)
    trained = run_dir / "train_result.json"
    if not trained.is_file():
        resume = "latest" if run_dir.is_dir() and checkpoint_dirs(str(run_dir)) else None
        if resume is None and run_dir.exists():
            shutil.rmtree(run_dir)  # our own run folder, killed before its first checkpoint: start it again
        settings = dict(learning_rate=scale.learning_rate, warmup_steps=scale.warmup_steps,
                        max_steps=scale.max_steps)
        settings.update(spec.training)  # the sweep's overrides
        config = TrainingConfig(
            preset="tiny-switchhead", output_dir=str(run_dir), model=fields, data=data, tokenizer=str(tokenizer_dir),
            vocab_size=scale.vocab_size, block_size=scale.block_size, batch_size=scale.batch_size,
            min_learning_rate=0.0, weight_decay=0.0, grad_clip=scale.grad_clip, seed=spec.seed,
            mixed_precision="bf16" if device == "cuda" else "no", eval_every=scale.eval_every,
            eval_batches=scale.eval_batches, log_every=10 if scale.max_steps >= 100 else 1,
            save_every=scale.save_every, keep_checkpoints=1, tensorboard=False, progress=False, resume=resume,
            **settings)
        load_before = os.getloadavg()[0]
        result = train(config)
        rows = _read_log(run_dir)
        throughput = [float(r["tokens_per_second"]) for r in rows if r["tokens_per_second"]][1:] or \
            [float(r["tokens_per_second"]) for r in rows if r["tokens_per_second"]]
        summary = dict(dataclasses.asdict(result), resumed=resume is not None,
                       tokens_per_second_median=statistics.median(throughput),
                       peak_memory_mb=max(float(r["peak_memory_mb"]) for r in rows),
                       torch_threads=torch.get_num_threads(), load_average_1min=[load_before, os.getloadavg()[0]])
        (run_dir / "train_result.json").write_text(json.dumps(summary, indent=1))
    summary = json.loads(trained.read_text())
    rows = _read_log(run_dir)
    curve = {"step": [int(r["step"]) for r in rows], "loss": [float(r["loss"]) for r in rows],
             "valid_step": [int(r["step"]) for r in rows if r["valid_loss"]],
             "valid_loss": [float(r["valid_loss"]) for r in rows if r["valid_loss"]]}

    # ------------------------------------------------------------------ perplexity
    evaluated = run_dir / "perplexity.json"
    if not evaluated.is_file():
        model = SwitchHeadForCausalLM.from_pretrained(str(run_dir)).to(device).eval()
        saved_tokenizer = load_tokenizer(str(run_dir))
        numbers = {}
        for split in ("valid", "test"):
            started = time.time()
            text = read_text(split_file(data, split))
            if split == "valid" and scale.valid_fraction < 1:
                text = text[: text.rfind("\n", 0, int(len(text) * scale.valid_fraction)) + 1]
            res = evaluate_perplexity(model, saved_tokenizer, text,
                                      context=scale.block_size, protocol=scale.perplexity_protocol,
                                      batch_size=scale.eval_batch_size, progress=False)
            numbers[split] = dict(res.as_dict(), seconds=time.time() - started)
        evaluated.write_text(json.dumps(numbers, indent=1))
        del model
    perplexity = json.loads(evaluated.read_text())

    # ------------------------------------------------------------------ zero-shot (lm-eval, our task folder)
    scored = run_dir / "zero_shot.json"
    if zero_shot and spec.seed < scale.zero_shot_seeds and not scored.is_file():
        scored.write_text(json.dumps(zero_shot_eval(run_dir, scale, device), indent=1))
    zero = json.loads(scored.read_text()) if scored.is_file() else None

    config = SwitchHeadConfig.from_pretrained(str(run_dir))
    record = dict(name=spec.name, model=spec.model, comparison=spec.comparison, role=spec.role, label=spec.label,
                  seed=spec.seed, scale=scale.name, fields=fields, parameters=summary["num_parameters"],
                  costs=cost_report(config, context=scale.block_size).as_dict(), train=summary, perplexity=perplexity, zero_shot=zero,
                  curve=curve, training_settings=json.loads((run_dir / "training_config.json").read_text()))
    record = portable_paths(record, out)
    (run_dir / RUN_RECORD).write_text(json.dumps(record, indent=1))
    return record


def blimp_subset(scale: Scale) -> list[str]:
    names = sorted(p.stem for p in BLIMP_DIR.glob("*.jsonl"))
    return names[: scale.blimp_paradigms] if scale.blimp_paradigms else names


def zero_shot_eval(run_dir: Path, scale: Scale, device: str) -> dict:
    """BLiMP (first `blimp_pairs` pairs of each chosen paradigm) and LAMBADA (first `lambada_passages`) through
    lm-eval with our task folder; lm-eval's `limit` takes the first N documents of each task."""
    from switchhead.evaluation.zero_shot import blimp_mean, run_lm_eval, summarize

    started = time.time()
    paradigms = blimp_subset(scale)
    numbers: dict = {"blimp_paradigms": len(paradigms), "blimp_pairs_per_paradigm": scale.blimp_pairs or 1000,
                     "lambada_passages": scale.lambada_passages or 5153}
    blimp = summarize(run_lm_eval(str(run_dir), [f"switchhead_blimp_{p}" for p in paradigms],
                                  limit=scale.blimp_pairs, batch_size=scale.eval_batch_size, device=device))
    numbers["blimp_acc"] = blimp_mean(blimp)
    lambada = summarize(run_lm_eval(str(run_dir), ["switchhead_lambada"], limit=scale.lambada_passages,
                                    batch_size=scale.eval_batch_size, device=device))["switchhead_lambada"]
    numbers["lambada_acc"], numbers["lambada_perplexity"] = lambada["acc"], lambada["perplexity"]
    numbers["seconds"] = time.time() - started
    return numbers


# ================================================================================================ diagnosis
def routing_statistics(run_dir: Path, data: str, tokens: int = 16_384, block_size: int = 256) -> dict:
    """How a trained model uses its experts on the first `tokens` validation tokens: for every router (each
    `ExpertSelection` module, by name), per head: the share of top-k picks each expert gets, the normalised
    entropy of that distribution (1 = uniform, 0 = one expert only) and the mean gate value of the picks."""
    import torch

    from switchhead import SwitchHeadForCausalLM
    from switchhead.evaluation.perplexity import read_text
    from switchhead.training import load_tokenizer

    model = SwitchHeadForCausalLM.from_pretrained(str(run_dir)).eval()
    tokenizer = load_tokenizer(str(run_dir))
    ids = torch.tensor(tokenizer(read_text(split_file(data, "valid"))[:400_000], add_special_tokens=False).input_ids)
    rows = ids[: tokens // block_size * block_size].view(-1, block_size)
    seen: dict[str, list] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__ == "ExpertSelection":
            def hook(module, _inputs, output, name=name):
                _, gates, index = output
                seen.setdefault(name, []).append((module, gates.detach().float(), index.detach()))
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for start in range(0, rows.shape[0], 8):
            model(input_ids=rows[start:start + 8], use_cache=False)
    for handle in hooks:
        handle.remove()
    report = {}
    for name, calls in seen.items():
        module = calls[0][0]
        groups, experts = module.num_groups, module.num_experts
        index = torch.cat([c[2] for c in calls]).reshape(-1)
        gates = torch.cat([c[1] for c in calls]).reshape(-1)
        counts = torch.bincount(index, minlength=groups * experts).view(groups, experts).double()
        share = counts / counts.sum(-1, keepdim=True)
        entropy = -(share * share.clamp_min(1e-12).log()).sum(-1) / math.log(experts) if experts > 1 else \
            torch.ones(groups)
        report[name] = dict(share=[[round(float(v), 4) for v in row] for row in share],
                            normalised_entropy=[round(float(v), 4) for v in entropy],
                            mean_gate=round(float(gates.mean()), 4))
    return report


def interleaved_throughput(scale: Scale, vocab_size: int, repetitions: int = 5, steps: int = 1) -> dict:
    """Training-step throughput of every model of the grid (seed 0 fields, random tokens, AdamW), measured
    round-robin so that a change in the machine's load hits every model alike; medians of `repetitions`.

    The per-run tokens/s in the training logs were taken hours apart on a shared machine and differ by load;
    these are the numbers to compare."""
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    models = {}
    for spec in plan(scale):
        if spec.seed == 0 and spec.model not in models and spec.role != "sweep":  # sweep: same architectures
            torch.manual_seed(0)
            config = SwitchHeadConfig(vocab_size=vocab_size, **resolved_fields(spec, scale, vocab_size))
            model = SwitchHeadForCausalLM(config).train()
            models[spec.model] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randint(0, vocab_size, (scale.batch_size, scale.block_size))
    times: dict[str, list[float]] = {name: [] for name in models}

    def step(model, optimizer):
        out = model(input_ids=batch, labels=batch, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for model, optimizer in models.values():  # warm-up
        step(model, optimizer)
    for _ in range(repetitions):
        for name, (model, optimizer) in models.items():
            started = time.perf_counter()
            for _ in range(steps):
                step(model, optimizer)
            times[name].append((time.perf_counter() - started) / steps)
    tokens = scale.batch_size * scale.block_size
    return {name: dict(step_seconds_median=statistics.median(t), tokens_per_second=tokens / statistics.median(t),
                       step_seconds=t) for name, t in times.items()}


# ================================================================================================ results
RUNS_PLACEHOLDER = "RUNS"  # what a results file writes for the grid's run folder (--out)


def portable_paths(value, out: Path):
    """`value` (a record: dicts, lists, strings) with every absolute path made one that reads the same on any
    machine: under the run folder `out` as RUNS/..., under the checkout relative to it, beside the checkout as
    ../..., anything else as its last component. Results files never carry the folders of the machine that ran."""
    if isinstance(value, dict):
        return {key: portable_paths(item, out) for key, item in value.items()}
    if isinstance(value, list):
        return [portable_paths(item, out) for item in value]
    if not isinstance(value, str) or not os.path.isabs(value):
        return value
    path = Path(os.path.normpath(value))
    for base, prefix in ((Path(os.path.normpath(out)), RUNS_PLACEHOLDER), (REPO, None), (REPO.parent, "..")):
        try:
            relative = path.relative_to(base)
        except ValueError:
            continue
        parts = [p for p in (prefix, relative.as_posix()) if p and p != "."]
        return "/".join(parts) or "."
    return path.name


def machine() -> dict:
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(host=platform.node(), cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def _mean_spread(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def aggregate(records: list[dict]) -> dict[str, dict]:
    """Per model (runs of all seeds): means and sample standard deviations of the headline numbers."""
    models: dict[str, dict] = {}
    for record in records:
        models.setdefault(record["model"], {"runs": []})["runs"].append(record)
    for name, entry in models.items():
        runs = entry["runs"]
        first = runs[0]
        entry.update(label=first["label"], comparison=first["comparison"], role=first["role"],
                     parameters=first["parameters"], seeds=sorted(r["seed"] for r in runs),
                     attention_macs=first["costs"]["attention_macs_table"],
                     attention_memory=first["costs"]["attention_memory_table"])
        for key, get in (("valid_ppl", lambda r: r["perplexity"]["valid"]["perplexity"]),
                         ("test_ppl", lambda r: r["perplexity"]["test"]["perplexity"]),
                         ("tokens_per_second", lambda r: r["train"]["tokens_per_second_median"]),
                         ("peak_memory_mb", lambda r: r["train"]["peak_memory_mb"]),
                         ("blimp_acc", lambda r: r["zero_shot"]["blimp_acc"] if r["zero_shot"] else None),
                         ("lambada_acc", lambda r: r["zero_shot"]["lambada_acc"] if r["zero_shot"] else None)):
            values = [v for v in (get(r) for r in runs) if v is not None]
            entry[key] = _mean_spread(values) if values else (None, None)
        del entry["runs"]
    return models


def _fmt(pair: tuple, digits: int = 2, scale: float = 1.0) -> str:
    mean, spread = pair
    if mean is None:
        return "-"
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {spread * scale:.{digits}f}" if spread is not None else "")


def claim_checks(records: list[dict], models: dict[str, dict]) -> list[dict]:
    """SwitchHead against each dense baseline: test perplexity ratio, seed-paired differences, cost shares."""
    checks = []
    test = {(r["model"], r["seed"]): r["perplexity"]["test"]["perplexity"] for r in records}
    for position in ("rope", "xl"):
        ours = f"{position}-switchhead"
        if ours not in models:
            continue
        baselines = [("dense-total", "same total heads"), ("dense-active", "same active heads")]
        if position == "rope":  # controls from the ablations: SwitchHead's output gate without experts
            baselines += [("ablation-gate", "control: same total heads + output gate"),
                          ("ablation-E1", "control: E=1 (H=2 + output gate)")]
        for baseline, title in baselines:
            theirs = f"{position}-{baseline}"
            if theirs not in models:
                continue
            seeds = sorted(set(models[ours]["seeds"]) & set(models[theirs]["seeds"]))
            differences = [test[(ours, s)] - test[(theirs, s)] for s in seeds]
            checks.append(dict(
                position=position, baseline=title, ratio=models[ours]["test_ppl"][0] / models[theirs]["test_ppl"][0],
                difference_mean=sum(differences) / len(differences) if differences else float("nan"),
                difference_sd=statistics.stdev(differences) if len(differences) > 1 else None,
                paired_seeds=len(seeds), macs_share=models[ours]["attention_macs"] / models[theirs]["attention_macs"],
                memory_share=models[ours]["attention_memory"] / models[theirs]["attention_memory"]))
    return checks


def sweep_rows(records: list[dict], scale: Scale) -> list[dict]:
    """Seed-0 test perplexity of each swept model at the grid's settings and at each sweep setting."""
    if "sweep" not in scale.comparisons or not scale.sweeps:
        return []
    test = {r["model"]: r["perplexity"]["test"]["perplexity"] for r in records if r["seed"] == 0}
    grid = {"switchhead": "rope-switchhead", "dense-total": "rope-dense-total", "gate": "rope-ablation-gate"}
    grid.update({ablation: f"rope-ablation-{ablation}" for _, ablation in scale.sweep_ablations})
    labels = {r["model"]: r["label"] for r in records}
    rows = []
    for role in list(scale.sweep_models) + list(dict.fromkeys(a for _, a in scale.sweep_ablations)):
        values = {f"lr {scale.learning_rate:g} (grid)": test.get(grid[role])}
        for tag, overrides in scale.sweeps:
            values[sweep_title(tag, dict(overrides), scale)] = test.get(f"rope-sweep-{tag}-{role}")
        if any(v is not None for v in values.values()):
            rows.append(dict(role=role, label=labels.get(grid[role], role), test_ppl=values))
    return rows


def comparison_rows(models: dict[str, dict], comparison: str) -> list[tuple[str, dict]]:
    if comparison == "switchall":
        names = ["rope-switchall", "rope-switchhead", "rope-dense-total"]
    elif comparison == "ablation":
        names = ["rope-switchhead"] + sorted(n for n in models if n.startswith("rope-ablation-"))
    elif comparison == "sweep":
        names = sorted(n for n in models if n.startswith("rope-sweep-"))
    else:
        names = [f"{comparison}-switchhead", f"{comparison}-dense-total", f"{comparison}-dense-active"]
    return [(n, models[n]) for n in names if n in models]


def plot_curves(records: list[dict], comparison: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = {name for name, _ in comparison_rows(aggregate(records), comparison)}
    chosen = [r for r in records if r["model"] in wanted]
    own = {"switchall": "switchall", "ablation": "ablation", "sweep": "sweep"}.get(comparison)
    if not chosen or (own and not any(r["role"] == own for r in chosen)):
        path.unlink(missing_ok=True)  # no stale picture of an earlier state
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {}
    for record in sorted(chosen, key=lambda r: (r["model"], r["seed"])):
        colour = colours.setdefault(record["model"], f"C{len(colours)}")
        label = record["label"] if record["seed"] == min(r["seed"] for r in chosen if r["model"] == record["model"]) \
            else None
        curve = record["curve"]
        window = 5
        smooth = [sum(curve["loss"][max(0, i - window + 1): i + 1]) / len(curve["loss"][max(0, i - window + 1): i + 1])
                  for i in range(len(curve["loss"]))]
        left.plot(curve["step"], smooth, color=colour, alpha=0.8, lw=1, label=label)
        right.plot(curve["valid_step"], curve["valid_loss"], color=colour, alpha=0.8, lw=1, marker="o", ms=3,
                   label=label)
    for axis, title in ((left, "training loss (moving average of 5 logs)"),
                        (right, "validation loss (trainer's periodic evaluation)")):
        axis.set_xlabel("step")
        axis.set_ylabel("cross-entropy (nats/token)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    low = min(min(r["curve"]["valid_loss"]) for r in chosen)
    right.set_ylim(low - 0.1, low + 1.5)
    left.set_ylim(low - 0.3, low + 2.0)
    right.legend(fontsize=7)
    figure.suptitle(COMPARISON_TITLES[comparison] + " (one line per seed)", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return True


def write_results(scale: Scale, out: Path, results_dir: Path, command: str) -> dict:
    """Collect every finished run of the grid and rewrite replication.json / .md / PNGs."""
    from switchhead.evaluation.accounting import format_count

    specs = plan(scale)
    records = [portable_paths(json.loads((out / s.name / RUN_RECORD).read_text()), out) for s in specs
               if (out / s.name / RUN_RECORD).is_file()]
    missing = [s.name for s in specs if not (out / s.name / RUN_RECORD).is_file()]
    models = aggregate(records)
    results_dir.mkdir(parents=True, exist_ok=True)
    report = dict(scale=dataclasses.asdict(scale), machine=machine(), command=command,
                  written=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  finished=[r["name"] for r in records], not_finished=missing, models=models, runs=records)
    (results_dir / "replication.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Replication runs (scale `{scale.name}`)", "",
             f"Generated by `experiments/replicate.py` at {report['written']}; command: `{command}`.", "",
             f"Scale: {scale.about}. Every model: the same {scale.vocab_size}-token BPE tokenizer trained on WikiText-2 train, "
             f"{scale.tokens:,} training tokens ({scale.max_steps} steps x {scale.batch_size} x {scale.block_size}), "
             f"AdamW (lr {scale.learning_rate}, wd 0), {scale.warmup_steps} warmup steps then cosine to 0, "
             f"gradient clip {scale.grad_clip}, dropout {scale.hidden_dropout}.", "",
             f"Perplexity: WikiText-2 " + (f"valid (its first {scale.valid_fraction:.0%}, cut at a line end)"
                                           if scale.valid_fraction < 1 else "valid") +
             f" and test (all), `evaluate_perplexity` protocol `{scale.perplexity_protocol}`, "
             f"context {scale.block_size}" + (f", stride {scale.block_size // 2}" if scale.perplexity_protocol ==
                                              "sliding" else "") + " (no XL memory at evaluation, for every model).",
             f"Zero-shot: lm-eval with the package's tasks; BLiMP = mean accuracy over "
             f"{len(blimp_subset(scale))} paradigms x first {scale.blimp_pairs or 1000} pairs, LAMBADA = accuracy on "
             f"the first {scale.lambada_passages or 5153} passages" + (
                 f"; only for seed{'s' if scale.zero_shot_seeds > 1 else ''} < {scale.zero_shot_seeds}"
                 if scale.zero_shot_seeds < scale.seeds else "") + ".", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if v is not None) + ".", "",
             "| model | params | attn MACs/layer | attn mem/layer | valid ppl | test ppl | BLiMP % | LAMBADA % | "
             "train tok/s (runs) | train tok/s (interleaved) | peak MB | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    throughput_file = results_dir / "replication_throughput.json"
    throughput = json.loads(throughput_file.read_text()) if throughput_file.is_file() else None
    report["throughput"] = throughput
    for comparison in scale.comparisons:
        for name, m in comparison_rows(models, comparison):
            if comparison == "switchall" and name != "rope-switchall":
                continue
            if comparison == "ablation" and name == "rope-switchhead":
                continue
            interleaved = f"{throughput['models'][name]['tokens_per_second']:.0f}" \
                if throughput and name in throughput["models"] else "-"
            lines.append(f"| {m['label']} | {m['parameters']:,} | {format_count(m['attention_macs'])} | "
                         f"{format_count(m['attention_memory'])} | {_fmt(m['valid_ppl'])} | {_fmt(m['test_ppl'])} | "
                         f"{_fmt(m['blimp_acc'], 1, 100)} | {_fmt(m['lambada_acc'], 1, 100)} | "
                         f"{_fmt(m['tokens_per_second'], 0)} | {interleaved} | {_fmt(m['peak_memory_mb'], 0)} | "
                         f"{len(m['seeds'])} |")
    lines += ["", "Mean ± sample standard deviation over seeds. Not finished: "
              + (", ".join(missing) if missing else "none") + ".", ""]
    checks = claim_checks(records, models)
    report["claim"] = checks
    (results_dir / "replication.json").write_text(json.dumps(report, indent=1))
    if checks:
        lines += ["## The paper's claim at this scale", "",
                  "Test perplexity of SwitchHead relative to each dense baseline (ratio of seed means; paired "
                  "differences over the seeds both have), and SwitchHead's share of the baseline's attention "
                  "MACs and memory. Targets: ratio to the same-total-heads baseline <= 1.02, to the "
                  "same-active-heads baseline < 1, MACs < 55%.", "",
                  "| positions | baseline | test ppl SwitchHead / baseline | paired difference (ppl) | seeds | "
                  "MACs share | memory share |", "|---|---|---|---|---|---|---|"]
        for check in checks:
            spread = f" ± {check['difference_sd']:.2f}" if check["difference_sd"] is not None else ""
            lines.append(f"| {check['position']} | {check['baseline']} | {check['ratio']:.3f} | "
                         f"{check['difference_mean']:+.2f}{spread} | {check['paired_seeds']} | "
                         f"{check['macs_share']:.0%} | {check['memory_share']:.0%} |")
        lines.append("")
    sweep = sweep_rows(records, scale)
    report["sweep"] = sweep
    (results_dir / "replication.json").write_text(json.dumps(report, indent=1))
    if sweep:
        columns = [f"lr {scale.learning_rate:g} (grid)"] + [sweep_title(tag, dict(o), scale) for tag, o in scale.sweeps]
        lines += ["## Learning rate and token budget (seed 0)", "",
                  "Test perplexity of seed 0 at the grid's settings and with one training setting changed (the "
                  "other settings, the model and the schedule's shape unchanged; the longer run has "
                  "proportionally longer warmup).", "",
                  "| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for row in sweep:
            lines.append(f"| {row['label']} | " + " | ".join(
                f"{row['test_ppl'][c]:.2f}" if row["test_ppl"].get(c) is not None else "-" for c in columns) + " |")
        by_role = {row["role"]: row["test_ppl"] for row in sweep}
        for other, title in (("dense-total", "same total heads"), ("gate", "gated control")):
            if "switchhead" in by_role and other in by_role:
                ours, theirs = by_role["switchhead"], by_role[other]
                lines.append(f"| ratio SwitchHead / {title} | " + " | ".join(
                    f"{ours[c] / theirs[c]:.3f}" if ours.get(c) and theirs.get(c) else "-" for c in columns) + " |")
        lines.append("")
    for comparison in scale.comparisons:
        image = results_dir / f"replication_{comparison}.png"
        if plot_curves(records, comparison, image):
            lines += [f"![{COMPARISON_TITLES[comparison]}]({image.name})", ""]
    # a hand-written reading below the marker survives regeneration
    target = results_dir / "replication.md"
    kept = ""
    if target.is_file() and READING_MARKER in target.read_text():
        kept = target.read_text().split(READING_MARKER, 1)[1]
    target.write_text("\n".join(lines) + "\n" + READING_MARKER + kept)
    return report


# ================================================================================================ driver
def _child_command(args, name: str) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--scale", args.scale, "--out", str(args.out),
               "--data", args.data, "--results-dir", str(args.results_dir), "--run", name]
    return command + (["--no-zero-shot"] if args.no_zero_shot else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="same as --scale smoke")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default runs/replication-SCALE)")
    parser.add_argument("--data", default=DEFAULT_DATA, help="WikiText folder (wiki.{train,valid,test}.tokens)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--only", default=None, help="regular expression: run only the matching run names")
    parser.add_argument("--stop-after", default=None, help="HH:MM (UTC): start no new run after this time")
    parser.add_argument("--no-zero-shot", action="store_true", help="skip BLiMP / LAMBADA")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the results files")
    parser.add_argument("--list", action="store_true", help="print the grid with parameter counts and exit")
    parser.add_argument("--throughput", action="store_true",
                        help="interleaved training-step throughput of every model -> replication_throughput.json")
    parser.add_argument("--diagnose", action="store_true",
                        help="expert usage of every finished SwitchHead/SwitchAll run -> replication_routing.json")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one run, in a child process
    args = parser.parse_args(argv)
    if args.smoke:
        args.scale = "smoke"
    scale = SCALES[args.scale]
    args.out = (args.out or REPO / "runs" / f"replication-{scale.name}").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if not os.path.isdir(args.data):
        parser.error(f"--data {args.data!r} is not a folder")
    split_file(args.data, "train")
    specs = {s.name: s for s in plan(scale)}
    command = "python experiments/replicate.py " + " ".join(
        str(portable_paths(a, args.out)) for a in (argv if argv is not None else sys.argv[1:]))

    if args.run is not None:  # child: one run
        if args.run not in specs:
            parser.error(f"unknown run {args.run!r}")
        run_one(specs[args.run], scale, args.out, args.data, args.out / "tokenizer", not args.no_zero_shot)
        return 0

    tokenizer_dir = ensure_tokenizer(args.out, args.data, scale.vocab_size)
    if args.list:
        from switchhead.training import load_tokenizer

        vocab = len(load_tokenizer(str(tokenizer_dir)))
        for spec in specs.values():
            fields = resolved_fields(spec, scale, vocab)
            print(f"{spec.name:28s} {count_parameters(fields, vocab):>11,}  d_ff={fields['intermediate_size']}  "
                  f"{spec.label}")
        return 0
    if args.throughput:
        from switchhead.training import load_tokenizer

        load = os.getloadavg()[0]
        numbers = interleaved_throughput(scale, len(load_tokenizer(str(tokenizer_dir))))
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / "replication_throughput.json").write_text(json.dumps(dict(
            machine=machine(), batch_size=scale.batch_size, block_size=scale.block_size,
            load_average_1min=[load, os.getloadavg()[0]], models=numbers), indent=1))
        for name, entry in numbers.items():
            print(f"{name:24s} {entry['tokens_per_second']:8.0f} tokens/s (median step {entry['step_seconds_median']:.3f} s)")
        return 0
    if args.diagnose:
        routing = {}
        for spec in specs.values():
            if (args.out / spec.name / RUN_RECORD).is_file() and spec.fields["attention_type"] == "switchhead":
                routing[spec.name] = routing_statistics(args.out / spec.name, args.data, block_size=scale.block_size)
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / "replication_routing.json").write_text(json.dumps(routing, indent=1))
        for run, routers in routing.items():
            for name, stats in routers.items():
                print(f"{run:24s} {name:40s} entropy per head {stats['normalised_entropy']} "
                      f"mean gate {stats['mean_gate']}")
        return 0
    if not args.report_only:
        for spec in specs.values():
            if args.only and not re.search(args.only, spec.name):
                continue
            if (args.out / spec.name / RUN_RECORD).is_file():
                print(f"[replicate] {spec.name}: finished earlier, skipped", flush=True)
                continue
            if args.stop_after:
                now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")
                if now >= args.stop_after:
                    print(f"[replicate] {now} UTC is past --stop-after {args.stop_after}: not starting "
                          f"{spec.name}", flush=True)
                    break
            started = time.time()
            print(f"[replicate] {spec.name}: starting", flush=True)
            code = subprocess.call(_child_command(args, spec.name))
            print(f"[replicate] {spec.name}: exit {code} after {time.time() - started:.0f} s", flush=True)
            write_results(scale, args.out, args.results_dir, command)
    report = write_results(scale, args.out, args.results_dir, command)
    print(f"[replicate] {len(report['finished'])} runs finished, {len(report['not_finished'])} not: "
          f"{args.results_dir / 'replication.json'}", flush=True)
    return 0 if not report["not_finished"] or args.only or args.stop_after else 1


if __name__ == "__main__":
    sys.exit(main())
