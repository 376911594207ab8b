"""Whole-model speed and memory: SwitchHead (47M presets, RoPE and XL) against parameter-matched dense baselines.

    python benchmarks/bench_model.py            # full mode (about 15-20 minutes on 2 busy cores)
    python benchmarks/bench_model.py --quick    # smoke test: 2 layers, short contexts, one repetition, no compiling
    python benchmarks/bench_model.py --decode-only --prompt 1024   # decoding after a long prompt (a long KV cache)
    python benchmarks/bench_model.py --family moeut --no-compile --no-compiled-train   # MoEUT's trio, eager

Models (fp32, same attention backend for all, sdpa by default), `--family switchhead` (the default):
- `wt103-45m-switchhead-rope` vs the dense 47M baseline with RoPE (`wt103-47m-dense-xl` geometry, RoPE positions);
- `wt103-47m-switchhead-xl` vs `wt103-47m-dense-xl`;
- reference rows: Mixtral and JetMoE from the installed Transformers, sized to the dense baseline's parameter count.
`--family moeut`: three models of about 44M parameters, RoPE, context 1024, no dropout:
- `moeut-44m` (MoEUT, Csordas et al. 2024: 2 distinct blocks applied 8 times);
- SwitchAll without shared layers at about the same size (`c4-47m-switchall-xl` with RoPE: 16 distinct layers);
- the MoEUT paper's dense 44M baseline (d=412, 16 layers, 10 heads of 41, MLP 2053: `wt103-47m-dense-xl` with
  RoPE at context 1024); ratios MoEUT / dense, SwitchAll / dense and MoEUT / SwitchAll. Results are named
  model_moeut_<mode>_*. `--quick` cuts every model to 2 layers, which leaves MoEUT's 2 shared blocks whole: its
  ratios check that the run works, they are not at equal parameters.

Measured, with the models interleaved inside every repetition and the median taken over repetitions:
- training step (forward + backward of the LM loss) time at context 256 and 512, and its peak memory: the rise of
  the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over the resident set before the
  step, each step run in a fresh child process so that freed-but-cached memory of other models does not hide it,
  with glibc's mmap threshold fixed at 64 KiB (`MALLOC_MMAP_THRESHOLD_`) so that the peak follows the live tensors
  rather than which freed blocks the allocator happened to keep;
- prefill time (batch 1, the whole context, with a KV cache) and decode tokens/s at batch 1 and 8 (greedy, one
  token per step through the cache), eager and compiled (inductor, static cache, `fullgraph=True`);
- the training step compiled with inductor (`torch.compile(model, fullgraph=True)`) at the first context, against
  the eager step interleaved with it (`--no-compiled-train` skips it);
- KV-cache bytes after the prefill.
Ratios are SwitchHead / dense (time ratios < 1 and tokens/s ratios > 1 favour SwitchHead). JSON and Markdown go to
`benchmarks/results/`, named after the machine, with threads, torch version and the load average before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp: no spin-waiting under load
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import StaticCache  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead.transformers_compat import output_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, file_slug, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 128  # default prompt length (tokens) for prefill and decoding
MMAP_THRESHOLD = 65536  # bytes: the memory children's fixed glibc mmap threshold (see `peak_memory_child`)
PAIRS = {  # family -> (SwitchHead model, dense baseline)
    "rope": ("switchhead-rope", "dense-rope"),
    "xl": ("switchhead-xl", "dense-xl"),
}
MOEUT_PAIRS = {  # column -> (model, the model it is divided by)
    "moeut/dense": ("moeut", "dense-moeut"),
    "switchall/dense": ("switchall-moeut", "dense-moeut"),
    "moeut/switchall": ("moeut", "switchall-moeut"),
}
FAMILIES = {  # --family -> (models in interleaving order, the ratios' pairs, reference rows allowed)
    "switchhead": (("switchhead-rope", "dense-rope", "switchhead-xl", "dense-xl"), PAIRS, True),
    "moeut": (("moeut", "switchall-moeut", "dense-moeut"), MOEUT_PAIRS, False),
}
MOEUT_CONTEXT = dict(position_encoding="rope", xl_memory_length=0, max_position_embeddings=1024, hidden_dropout=0.0)


# ------------------------------------------------------------------------------------------------ models
def build(name: str, quick: bool, attn: str):
    """A freshly initialised model by benchmark name (eval mode)."""
    tiny = dict(num_hidden_layers=2) if quick else {}
    torch.manual_seed(0)
    if name == "switchhead-rope":
        config = SwitchHeadConfig.from_preset("wt103-45m-switchhead-rope", **tiny)
    elif name == "dense-rope":
        config = SwitchHeadConfig.from_preset("wt103-47m-dense-xl", position_encoding="rope", xl_memory_length=0,
                                              max_position_embeddings=512, **tiny)
    elif name == "switchhead-xl":
        config = SwitchHeadConfig.from_preset("wt103-47m-switchhead-xl", **tiny)
    elif name == "dense-xl":
        config = SwitchHeadConfig.from_preset("wt103-47m-dense-xl", **tiny)
    elif name == "moeut":
        config = SwitchHeadConfig.from_preset("moeut-44m", **tiny)
    elif name == "switchall-moeut":
        config = SwitchHeadConfig.from_preset("c4-47m-switchall-xl", **MOEUT_CONTEXT, **tiny)
    elif name == "dense-moeut":
        config = SwitchHeadConfig.from_preset("wt103-47m-dense-xl", **MOEUT_CONTEXT, **tiny)
    elif name in ("mixtral", "jetmoe"):
        return build_reference(name, quick, attn)
    else:
        raise ValueError(f"unknown model {name!r}")
    config._attn_implementation = attn
    return SwitchHeadForCausalLM(config).eval()


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_reference(name: str, quick: bool, attn: str):
    """Mixtral / JetMoE with d=412, 16 layers, vocab 8000, the MLP width chosen to match the dense baseline."""
    target = _count(build("dense-rope", quick, attn))
    layers = 2 if quick else 16

    def make(width):
        if name == "mixtral":
            config = transformers.MixtralConfig(
                vocab_size=8000, hidden_size=412, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=4, head_dim=104, intermediate_size=width, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False)
        else:
            config = transformers.JetMoeConfig(
                vocab_size=8000, hidden_size=412, num_hidden_layers=layers, num_key_value_heads=2, kv_channels=104,
                intermediate_size=width, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                tie_word_embeddings=False)
        config._attn_implementation = attn
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    low, high = make(64), make(128)
    per_unit = (_count(high) - _count(low)) / 64
    width = max(16, 8 * round((64 + (target - _count(low)) / per_unit) / 8))  # grouped_mm: 16-byte rows
    return make(width)


# ------------------------------------------------------------------------------------------------ measurements
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(model, batch: int, context: int, module=None):
    """A training step of `model` (`module`: the model behind a compiled wrapper, for its config and layers)."""
    module = model if module is None else module
    ids = torch.randint(1, module.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    module.train()
    for layer in module.modules():  # timing only: no dropout randomness
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0

    def step():
        module.train()  # the decoding measurements in between switch to eval mode
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return step


def prefill_and_decode(model, batch: int, prompt: int, steps: int, compiled: bool):
    """(prefill seconds, decode seconds for `steps` tokens per row, KV-cache bytes after the prefill)."""
    model.eval()
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, prompt + steps, dtype=torch.long)
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps) if compiled else None
    forward = model._compiled_forward if compiled else model
    with torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
        prefill = time.perf_counter() - start
        cache = output_cache(out)
        kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                       if t is not None)
        if compiled:
            kv_bytes = kv_bytes * prompt // (prompt + steps)  # the static cache holds room for the decoded tokens
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for i in range(steps):
            position = torch.full((batch, 1), prompt + i)
            # compiled (static cache): a mask of the cache's full length every step, so that no shape changes
            # (the not yet written slots are future keys, masked by causality); eager: the usual growing mask
            step_mask = mask if compiled else mask[:, :prompt + i + 1]
            out = forward(input_ids=token, attention_mask=step_mask, position_ids=position,
                          cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return prefill, decode, kv_bytes


def compile_decoder(model):
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model._compiled_forward = torch.compile(model.forward, fullgraph=True, dynamic=False)


def peak_memory_child(name: str, batch: int, context: int, quick: bool, attn: str) -> dict:
    """Run one training step of `name` in a fresh process; returns its peak RSS rise (bytes)."""
    code = (
        "import sys, json; sys.path.insert(0, %r); import bench_model as b; "
        "print(json.dumps(b._peak_memory(%r, %d, %d, %r, %r)))" % (str(Path(__file__).parent), name, batch, context,
                                                                  quick, attn)
    )
    # glibc's mmap threshold fixed (not raised as big blocks are freed): every large tensor is mapped on allocation
    # and unmapped when freed, so the peak resident set follows the live tensors; with the default dynamic threshold
    # freed blocks stay in the heap by chance, and the same step's peak varied by up to 30% (570-742 MiB, dense RoPE)
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    if result.returncode != 0:
        return {"error": result.stderr[-500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_memory(name: str, batch: int, context: int, quick: bool, attn: str) -> dict:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = build(name, quick, attn)
    step = train_step(model, batch, context)
    try:  # hand freed-but-cached heap (model construction's temporaries) back, so the rise is not hidden by it
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    step()
    return {"peak_rise_bytes": _status("VmHWM") - before, "parameters": _count(model)}


# ------------------------------------------------------------------------------------------------ driver
def machine() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "hostname": platform.node()}


def median(values):
    return statistics.median(values) if values else None


def run(args) -> dict:
    quick = args.quick
    family, pairs, references = FAMILIES[args.family]
    names = list(family) + ([] if args.no_reference or not references else ["mixtral", "jetmoe"])
    contexts = [32, 64] if quick else [256, 512]
    train_batch = 1 if quick else args.train_batch
    prompt, steps = (16, min(4, args.decode_steps)) if quick else (args.prompt, args.decode_steps)
    decode_batches = [1, 8]
    models = {name: build(name, quick, args.attn) for name in names}
    report = {"machine": machine(), "mode": "quick" if quick else "full", "family": args.family,
              "attn_implementation": args.attn,
              "load_average_before": os.getloadavg(), "parameters": {n: _count(m) for n, m in models.items()},
              "settings": {"train_batch": train_batch, "contexts": contexts, "prompt": prompt,
                           "decode_steps": steps, "decode_batches": decode_batches, "reps": args.reps,
                           "memory_malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_",
                                                                          str(MMAP_THRESHOLD))}}
    samples: dict[str, list[float]] = {}

    def add(key, value):
        samples.setdefault(key, []).append(value)

    if args.decode_only:  # no training steps, no memory children: prefill and decoding only
        contexts, args.compiled_train, args.no_memory = [], False, True
        report["settings"]["contexts"] = []
    steps_of = {(n, c): train_step(m, train_batch, c) for n, m in models.items() for c in contexts}
    for fn in steps_of.values():  # warm-up
        fn()
    for n, m in models.items():
        prefill_and_decode(m, 1, prompt, 2, compiled=False)
    for rep in range(args.reps):  # interleaved: every model once per repetition
        for context in contexts:
            for n in names:
                add(f"train_s/{n}/{context}", timed(steps_of[(n, context)]))
        for n in names:
            prefill, _, kv = prefill_and_decode(models[n], 1, prompt, 1, compiled=False)
            add(f"prefill_s/{n}", prefill)
            report.setdefault("kv_cache_bytes", {})[n] = kv
            for batch in decode_batches:
                _, decode, _ = prefill_and_decode(models[n], batch, prompt, steps, compiled=False)
                add(f"decode_tok_s/eager/{n}/{batch}", batch * steps / decode)
        print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    compiled_names = [] if quick or args.no_compile else list(family)
    for n in compiled_names:
        compile_decoder(models[n])
        for batch in args.compiled_batches:
            start = time.perf_counter()
            # compiles: as many steps as the timed runs, so that the static cache (and the graph) has their shape
            prefill_and_decode(models[n], batch, prompt, steps, compiled=True)
            report.setdefault("compile_s", {})[f"{n}/{batch}"] = time.perf_counter() - start
    for rep in range(args.reps if compiled_names else 0):
        for batch in args.compiled_batches:
            for n in compiled_names:
                _, decode, _ = prefill_and_decode(models[n], batch, prompt, steps, compiled=True)
                add(f"decode_tok_s/compiled/{n}/{batch}", batch * steps / decode)
    compiled_train = {}  # inductor, fullgraph: the training step (forward + backward) at the first context
    train_context = contexts[0] if contexts else None
    for n in compiled_names if args.compiled_train else []:
        compiled_model = torch.compile(models[n], fullgraph=True, dynamic=False)
        compiled_train[n] = train_step(compiled_model, train_batch, train_context, models[n])
        report.setdefault("compile_s", {})[f"{n}/train@{train_context}"] = timed(compiled_train[n])  # compiles
    for rep in range(args.reps if compiled_train else 0):
        for n in compiled_train:
            add(f"train_s/{n}/{train_context}", timed(steps_of[(n, train_context)]))  # eager, interleaved again
            add(f"train_s_compiled/{n}/{train_context}", timed(compiled_train[n]))
    del steps_of
    memory = {}
    for context in [] if args.no_memory else contexts[:1] if quick else contexts:  # quick: one context, one pair
        for n in names[:2] if quick else names:
            memory[f"{n}/{context}"] = peak_memory_child(n, train_batch, context, quick, args.attn)
    report["train_peak_memory"] = memory
    report["medians"] = {key: median(values) for key, values in samples.items()}
    report["samples"] = samples
    report["ratios"] = ratios(report, contexts, decode_batches, args.compiled_batches if compiled_names else [],
                              train_context if compiled_train else None, pairs)
    report["load_average_after"] = os.getloadavg()
    return report


def paired(report, key: str, moe: str, dense: str) -> float | None:
    """The median over repetitions of SwitchHead / dense measured back to back in the same repetition ("paired"):
    less exposed to other jobs' load changing between repetitions than the ratio of the two medians."""
    a, b = (report["samples"].get(key.format(name), []) for name in (moe, dense))
    return median([x / y for x, y in zip(a, b)]) if a and len(a) == len(b) else None


def ratios(report, contexts, decode_batches, compiled_batches, compiled_train_context=None, pairs=None) -> dict:
    """{column: {measure: the first model's value / the second's}} for each pair of `pairs` (default PAIRS)."""
    med, out = report["medians"], {}
    for family, (moe, dense) in (pairs or PAIRS).items():
        row = {}
        for context in contexts:
            row[f"train_time@{context}"] = med[f"train_s/{moe}/{context}"] / med[f"train_s/{dense}/{context}"]
            a, b = (report["train_peak_memory"].get(f"{x}/{context}", {}).get("peak_rise_bytes") for x in (moe, dense))
            row[f"train_peak_memory@{context}"] = a / b if a and b else None
        row["prefill_time"] = med[f"prefill_s/{moe}"] / med[f"prefill_s/{dense}"]
        for batch in decode_batches:
            row[f"decode_tok_s_eager@b{batch}"] = (med[f"decode_tok_s/eager/{moe}/{batch}"]
                                                   / med[f"decode_tok_s/eager/{dense}/{batch}"])
            row[f"decode_tok_s_eager@b{batch} paired"] = paired(report, f"decode_tok_s/eager/{{}}/{batch}", moe, dense)
        for batch in compiled_batches:
            row[f"decode_tok_s_compiled@b{batch}"] = (med[f"decode_tok_s/compiled/{moe}/{batch}"]
                                                      / med[f"decode_tok_s/compiled/{dense}/{batch}"])
            row[f"decode_tok_s_compiled@b{batch} paired"] = paired(report, f"decode_tok_s/compiled/{{}}/{batch}", moe,
                                                                   dense)
            row[f"compiled_over_eager_switchhead@b{batch}"] = (med[f"decode_tok_s/compiled/{moe}/{batch}"]
                                                               / med[f"decode_tok_s/eager/{moe}/{batch}"])
        if compiled_train_context is not None:
            c = compiled_train_context
            row[f"train_time_compiled@{c}"] = med[f"train_s_compiled/{moe}/{c}"] / med[f"train_s_compiled/{dense}/{c}"]
            row[f"compiled_over_eager_train_time_switchhead@{c}"] = (med[f"train_s_compiled/{moe}/{c}"]
                                                                     / med[f"train_s/{moe}/{c}"])
        row["kv_cache_bytes"] = report["kv_cache_bytes"][moe] / report["kv_cache_bytes"][dense]
        out[family] = row
    return out


COLUMN_TITLES = {"rope": "RoPE", "xl": "XL", "moeut/dense": "MoEUT / dense", "switchall/dense": "SwitchAll / dense",
                 "moeut/switchall": "MoEUT / SwitchAll"}


def markdown(report) -> str:
    m = report["machine"]
    columns = list(report["ratios"])
    scope = "" if report["settings"]["contexts"] else ", prefill and decoding only"
    title = "MoEUT, SwitchAll and dense" if report.get("family") == "moeut" else "Whole-model benchmark"
    lines = [f"# {title} ({report['mode']} mode{scope})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, transformers "
             f"{m['transformers']}, OMP_WAIT_POLICY={m['omp_wait_policy']}, attention {report['attn_implementation']}, "
             f"fp32. Load average before {tuple(round(x, 2) for x in report['load_average_before'])}, after "
             f"{tuple(round(x, 2) for x in report['load_average_after'])}: the machine was shared with other jobs "
             f"(measured under load). Settings: {report['settings']}.", "",
             "## Ratios (" + ("SwitchHead / dense baseline" if columns == ["rope", "xl"] else "model / model")
             + ", same run; time and memory: lower is better, tokens/s: higher)", "",
             "| measure | " + " | ".join(COLUMN_TITLES.get(c, c) for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    keys = list(report["ratios"][columns[0]])
    for key in keys:
        vals = [report["ratios"][f].get(key) for f in columns]
        lines.append(f"| {key} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in vals) + " |")
    lines += ["", "## Medians", "", "| measure | value |", "|---|---|"]
    for key, value in sorted(report["medians"].items()):
        lines.append(f"| {key} | {value:.4g} |")
    lines += ["", "## Parameters, KV cache, training peak memory", "", "| model | parameters | KV-cache bytes | "
              + " | ".join(f"peak rise @{c} (MiB)" for c in report["settings"]["contexts"]) + " |",
              "|---|---|---|" + "---|" * len(report["settings"]["contexts"])]
    for name, count in report["parameters"].items():
        peaks = [report["train_peak_memory"].get(f"{name}/{c}", {}).get("peak_rise_bytes")
                 for c in report["settings"]["contexts"]]
        lines.append(f"| {name} | {count / 1e6:.2f}M | {report['kv_cache_bytes'].get(name, 0)} | "
                     + " | ".join("n/a" if p is None else f"{p / 2**20:.0f}" for p in peaks) + " |")
    if report.get("compile_s"):
        lines += ["", "Compile time, including the first call (s): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in report["compile_s"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (2 layers, short contexts, 1 rep)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3, quick 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--train-batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=PROMPT,
                        help="prompt tokens before decoding (the KV cache's length); results of another length than "
                             f"{PROMPT} are named model_<mode>_p<prompt>_*")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--compiled-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-compiled-train", dest="compiled_train", action="store_false",
                        help="skip the compiled (inductor) training steps")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--decode-only", action="store_true",
                        help="prefill and decoding only (no training steps, no memory); results named model_decode_*")
    parser.add_argument("--no-reference", action="store_true", help="skip the Mixtral / JetMoE rows")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="switchhead",
                        help="switchhead: the 47M SwitchHead / dense pairs (RoPE, XL) and the reference rows; moeut: "
                        "MoEUT 44M, SwitchAll and the MoEUT paper's dense baseline")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (Markdown beside it)")
    args = parser.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    report = run(args)
    kind = "decode" if args.decode_only else report["mode"]
    if args.prompt != PROMPT and not args.quick:
        kind += f"_p{args.prompt}"  # another prompt length: its own result files
    slug = file_slug(report["machine"]["cpu"])
    family = "" if args.family == "switchhead" else f"{args.family}_"
    save_results(args.out or RESULTS / f"model_{family}{kind}_cpu_{slug}_{args.threads}t.json", report,
                 markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
