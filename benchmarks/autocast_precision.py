"""How far each experts implementation's logits move from fp32 under CPU autocast (bf16 and fp16).

    python benchmarks/autocast_precision.py [--steps 40] [--out benchmarks/results/autocast_precision_cpu.json]

For every variant of a tiny SwitchAll / SwitchHead model (`VARIANTS`: both expert sides, value-only, output-only,
head width 13, k = 1, k = E, more experts, sigma-MoE MLP under dense attention), on its seed-0 random weights and on
the same weights after `--steps` AdamW steps on a fixed synthetic task (`trained`), every name of
`expert_ops.EXPERTS_IMPLEMENTATIONS` runs 2 x 32 tokens under `torch.autocast("cpu", dtype)`; the largest logit
error is taken against the fp32 logits of "eager" (every name agrees with it to ~1e-6 in fp32).

Two columns per dtype, because top-k routing is discontinuous:

- `free`: the model as it runs. Router logits come from a low-precision GEMM, so a token whose two best experts are
  nearly tied can pick another expert than in fp32; one such flip moves a logit by O(1). Which tokens flip depends
  on the last bits of the router's input, so this column ranks luck as much as arithmetic: across names it varies
  by the routes that happened to flip, not by how a name rounds.
- `fixed`: every router keeps the experts it chose in the fp32 run (`fp32_routes`); its gates are still the autocast
  run's own sigmoid scores of those experts. What is left is the rounding of each formulation (and of the shared
  dense layers): the column a name controls, and the one the tests hold to eager's (tests/model/
  test_autocast_precision.py).

Writes JSON and Markdown to benchmarks/results/ with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.expert_ops import EXPERTS_IMPLEMENTATIONS
from switchhead.routing import ExpertSelection

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, describe, file_slug, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = list(EXPERTS_IMPLEMENTATIONS)  # "eager" first
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# tiny-switchall with these fields changed; every variant keeps a sigma-MoE MLP except "switchhead"
VARIANTS = {
    "switchall": {},
    "switchhead": dict(mlp_type="dense", intermediate_size=128),
    "value-only": dict(attention_expert_projections="value"),
    "output-only": dict(attention_expert_projections="output"),
    "head-width-13": dict(head_dim=13),
    "k=1": dict(num_attention_experts_per_tok=1, num_mlp_experts_per_tok=1),
    "k=E": dict(num_attention_experts_per_tok=4, num_mlp_experts_per_tok=8),
    "E=8/16": dict(num_attention_experts=8, num_mlp_experts=16, num_mlp_experts_per_tok=4),
    "dense-attention": dict(attention_type="dense", num_attention_heads=4),
}
WEIGHTS = ("random", "trained")
TOKENS = (2, 32)  # batch, length


def model_of(variant: str) -> SwitchHeadForCausalLM:
    """The variant's model from seed 0, fp32, eval mode."""
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchall", **VARIANTS[variant])).eval()


def task_batch(vocab: int, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences a tiny model learns in a few dozen steps: each is an arithmetic progression of token ids (random start
    and step), so the next token follows from the two before it."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    step = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + step * torch.arange(length)) % vocab


def trained(variant: str, steps: int = 40) -> SwitchHeadForCausalLM:
    """The variant's model after `steps` AdamW steps (lr 3e-3, 8 x 32 tokens of `task_batch`, fp32, eager experts),
    deterministic: its weights have moved away from the initialisation (routers have preferences, experts differ)."""
    model = model_of(variant).train()
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        ids = task_batch(model.config.vocab_size, 8, 32, generator)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval()


@functools.lru_cache(maxsize=None)
def weights_of(variant: str, weights: str, steps: int = 40) -> dict[str, torch.Tensor]:
    """The variant's state dict, random or trained (computed once per process)."""
    model = model_of(variant) if weights == "random" else trained(variant, steps)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def probe_inputs(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(2))


@contextlib.contextmanager
def fp32_routes(record: list | None = None, replay: list | None = None):
    """Every `ExpertSelection` call appends its expert choice to `record`, or takes its choice from `replay` (in call
    order) and gates the replayed experts with its own sigmoid scores: routing held to another run's choices."""
    original = ExpertSelection.select
    replayed = iter(replay) if replay is not None else None

    def select(self, logits):
        logits, gates, index = original(self, logits)
        if record is not None:
            record.append(index)
        if replayed is not None:
            index = next(replayed)
            scores = torch.sigmoid(logits).view(index.shape[0], -1, self.num_experts)
            gates = scores.gather(-1, index)
        return logits, gates, index

    ExpertSelection.select = select
    try:
        yield
    finally:
        ExpertSelection.select = original


def logit_errors(model: SwitchHeadForCausalLM, names=NAMES, dtypes=DTYPES) -> dict:
    """{(name, dtype label, "free" | "fixed"): largest |logit - fp32 logit|} for the model's current weights."""
    ids = probe_inputs(model.config.vocab_size)
    routes: list = []
    model.set_experts_implementation("eager")
    with torch.no_grad(), fp32_routes(record=routes):
        reference = model(input_ids=ids, use_cache=False).logits
    errors = {}
    for name in names:
        model.set_experts_implementation(name)
        for label, dtype in dtypes.items():
            for routing in ("free", "fixed"):
                replay = routes if routing == "fixed" else None
                with torch.no_grad(), fp32_routes(replay=replay), torch.autocast("cpu", dtype=dtype):
                    logits = model(input_ids=ids, use_cache=False).logits
                errors[name, label, routing] = (logits.float() - reference).abs().max().item()
    model.set_experts_implementation("eager")
    return errors


def measure(variants=VARIANTS, weights=WEIGHTS, steps: int = 40) -> dict:
    """{variant: {weights: {"name dtype routing": error}}} over the given variants and weights."""
    report = {}
    for variant in variants:
        model = model_of(variant)
        report[variant] = {}
        for kind in weights:
            model.load_state_dict(weights_of(variant, kind, steps))
            report[variant][kind] = {" ".join(key): value for key, value in logit_errors(model).items()}
    return report


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = ["# Logit error under CPU autocast against fp32, per experts implementation", "",
             f"{machine['device']}, {machine['threads']} threads, torch {machine['torch']}; tiny-switchall variants, "
             f"{TOKENS[0]} x {TOKENS[1]} tokens; random weights (seed 0) and after {report['steps']} AdamW steps. "
             f"`free`: routing as it runs (route flips included); `fixed`: routing held to the fp32 run's choices "
             f"(benchmarks/autocast_precision.py). In brackets: the error over eager's.", ""]
    for label in DTYPES:
        for routing in ("fixed", "free"):
            lines += [f"## {label}, routing {routing}", "",
                      "| variant | weights | " + " | ".join(NAMES) + " |",
                      "|---|---|" + "---|" * len(NAMES)]
            for variant, kinds in report["errors"].items():
                for kind, errors in kinds.items():
                    eager = errors[f"eager {label} {routing}"]
                    values = [errors[f"{name} {label} {routing}"] for name in NAMES]
                    cells = [f"{value:.4f} ({value / eager:.2f})" for value in values]
                    lines.append(f"| {variant} | {kind} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="AdamW steps of the trained weights")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    report = dict(machine=describe(torch.device("cpu")), steps=args.steps,
                  errors=measure({v: VARIANTS[v] for v in variants}, WEIGHTS, args.steps))
    slug = file_slug(cpu_name())
    save_results(args.out or RESULTS / f"autocast_precision_cpu_{slug}.json", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
