"""End to end on a GPU: SwitchHead against its parameter-matched dense baseline, training and inference.

    python benchmarks/bench_e2e.py                 # CUDA: 47M and 262M presets, RoPE and XL, bf16 autocast
    python benchmarks/bench_e2e.py --only 262m     # the pairs whose name contains this text
    python benchmarks/bench_e2e.py --only moeut    # MoEUT 44M against the MoEUT paper's dense 44M baseline
    python benchmarks/bench_e2e.py --cpu-smoke     # anywhere: 2-layer models, tiny batches (checks that it runs)

Pairs (SwitchHead preset vs the dense baseline with the same attention backend, sdpa, and the same positions):
47m-rope (wt103-45m-switchhead-rope vs wt103-47m-dense-xl with RoPE), 47m-xl, 262m-rope (wt103-243m-switchhead-rope
vs wt103-262m-dense-xl with RoPE), 262m-xl; and moeut-44m: MoEUT (Csordas et al. 2024, shared layers: 2 blocks applied
8 times) against the dense 44M baseline of its paper (d=412, 16 layers, 10 heads of 41, MLP 2053, RoPE, context
1024: the wt103-47m-dense-xl geometry), both at MoEUT's batch 64 x 1024 (in that pair's rows "switchhead" is
MoEUT; the SwitchHead targets below do not apply to it). For each model, with the two models of a pair interleaved
in every repetition and medians taken:
- training step: forward + backward + AdamW step at the paper's batch (64) and context, fp32 weights, bf16
  autocast; its time (CUDA events) and peak memory (the model's weights, gradients and optimizer state plus the
  rise of `torch.cuda.max_memory_allocated` during the step);
- prefill: batch 1, a prompt of the training context, with the KV cache;
- greedy decoding through the KV cache at batch 1 and 32 after a 1024-token prompt (`--prompt`): tokens per second;
- KV-cache bytes after the prefill.
The XL models train without carrying memory across segments (`use_cache=False`), like the dense XL baseline.
Ratios are SwitchHead / dense. The paper measured 0.65-0.72x time and 0.61-0.65x memory for training; the targets
set for this benchmark were a 47M step at <= 0.7x the dense time and memory, and >= 1.3x the dense decode
tokens/s at batch 32 after 1024 tokens. `--time-budget` starts no pair that the time left cannot hold (judged from
the pairs already run), so that a caller with a fixed budget keeps the pairs that finished.
JSON and Markdown go to benchmarks/results/ (or `--out-dir`), named after the device, with the GPU, driver,
torch, triton and transformers versions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead.training.paper import PAPER_TRAINING  # noqa: E402
from switchhead.transformers_compat import output_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROPE_DENSE = dict(position_encoding="rope", xl_memory_length=0)
PAIRS = {  # name -> ((SwitchHead preset, overrides), (dense preset, overrides))
    "47m-rope": (("wt103-45m-switchhead-rope", {}),
                 ("wt103-47m-dense-xl", dict(ROPE_DENSE, max_position_embeddings=512))),
    "47m-xl": (("wt103-47m-switchhead-xl", {}), ("wt103-47m-dense-xl", {})),
    "262m-rope": (("wt103-243m-switchhead-rope", {}),
                  ("wt103-262m-dense-xl", dict(ROPE_DENSE, max_position_embeddings=1024))),
    "262m-xl": (("wt103-262m-switchhead-xl", {}), ("wt103-262m-dense-xl", {})),
    "moeut-44m": (("moeut-44m", {}), ("wt103-47m-dense-xl", dict(ROPE_DENSE, max_position_embeddings=1024))),
}
TARGETS = {"train_time": ("<=", 0.7, "47m"), "train_peak_memory": ("<=", 0.7, "47m"),
           "decode_tok_s@b32": (">=", 1.3, "")}  # measure -> (sign, bound, the pairs it applies to)
PAPER = "training time 0.65-0.72x, memory 0.61-0.65x (paper, Table 4)"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, 2-layer models, tiny batches, one repetition")
    parser.add_argument("--only", default="", help="run only the pairs whose name contains this text")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians over them)")
    parser.add_argument("--train-steps", type=int, default=3, help="timed optimizer steps per repetition")
    parser.add_argument("--batch", type=int, default=None, help="training batch (default: the paper's, 64)")
    parser.add_argument("--decode-batches", default="1,32", help="comma separated decode batch sizes")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt length of the decode measurement")
    parser.add_argument("--decode-steps", type=int, default=64, help="tokens decoded per row")
    parser.add_argument("--attn", default="sdpa", help="attention backend of every model (eager, sdpa, ...)")
    parser.add_argument("--experts-implementation", default=None,
                        help="how SwitchHead's experts run (eager, switchhead_batched, switchhead_grouped, "
                             "cvmm; default: the model's automatic choice)")
    parser.add_argument("--compiled-decode", action="store_true",
                        help="time only greedy decoding, through `generate` with a static cache and its compiled "
                             "step (CUDA graphs on a GPU), at each --decode-batches (training and prefill not timed)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="result file stem (default: e2e_<device>)")
    parser.add_argument("--no-markdown", action="store_true", help="write the JSON only (scripts/gpu/gpu_report.py "
                        "renders it later)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: start no pair the time left cannot hold (the JSON is written after each pair)")
    args = parser.parse_args(argv)
    try:
        args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--decode-batches must be integers separated by commas; got {args.decode_batches!r}")
    if args.cpu_smoke:
        args.reps, args.train_steps, args.prompt, args.decode_steps = 1, 1, 8, 2
        args.decode_batches = [b for b in args.decode_batches if b <= 2] or [1]
    return args


# ------------------------------------------------------------------------------------------------ models
def build(preset: str, overrides: dict, device, smoke: bool, attn: str, experts: str | None = None):
    small = dict(num_hidden_layers=2, hidden_dropout=0.0) if smoke else dict(hidden_dropout=0.0)
    config = SwitchHeadConfig.from_preset(preset, **{**overrides, **small})
    config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = SwitchHeadForCausalLM(config)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


class Clock:
    """Seconds of a callable: CUDA events on a GPU, wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class Trainer:
    """One model with its AdamW optimizer; `step()` is forward + backward + optimizer step under autocast."""

    def __init__(self, model, batch: int, context: int, device, autocast_dtype):
        self.model, self.device = model.train(), device
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=2.5e-4, fused=cuda)
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=generator).to(device)
        self.autocast = dict(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)

    def step(self):
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(**self.autocast):
            loss = self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        self.optimizer.step()

    def static_bytes(self) -> int:
        """Weights and optimizer state (the gradients are counted in the step's rise: they are freed between)."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        return total

    def peak_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.step()
        torch.cuda.synchronize()
        return self.static_bytes() + torch.cuda.max_memory_allocated() - before


def prefill_and_decode(model, batch: int, prompt: int, steps: int, device, autocast_dtype, clock):
    """(prefill seconds, decode seconds for `steps` tokens per row, KV-cache bytes after the prefill)."""
    model.eval()
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    state = {}

    def prefill():
        state["out"] = model(input_ids=ids, use_cache=True)

    def decode():
        out = state["out"]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, cache=output_cache(out), use_cache=True)

    with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                         enabled=autocast_dtype is not None):
        prefill_s = clock(prefill)
        cache = output_cache(state["out"])
        kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                       if t is not None)
        decode_s = clock(decode) if steps else 0.0
    return prefill_s, decode_s, kv_bytes


def compiled_decode(model, batch: int, prompt: int, steps: int, device, clock, reps: int) -> dict:
    """Greedy decoding through `generate` with a static cache, whose decoding step Transformers compiles
    (fullgraph; `mode="reduce-overhead"`, i.e. CUDA graphs, on a GPU): seconds to compile, decode tokens per second
    of each repetition, and whether the compiled tokens equal the eager loop's. The model is in bf16 (weights, not
    autocast: a static cache is allocated in the model's dtype, and autocast's bf16 keys cannot be copied into an
    fp32 one). The decode time of a repetition is generate(1 + steps new tokens) less generate(1 new token): the
    prompt's prefill and the first token cancel; the static cache is sized by the first, longer call and reused by
    the second, so neither recompiles."""
    from transformers import CompileConfig

    model.eval().to(torch.bfloat16)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    mode = "reduce-overhead" if device.type == "cuda" else "default"  # CUDA graphs where there is CUDA
    config = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
    config._compile_all_devices = True  # Transformers compiles on accelerators only unless told
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))

    def generate(new_tokens, **kwargs):
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common, **kwargs)

    static = dict(cache_implementation="static", compile_config=config)
    with torch.no_grad():
        torch._dynamo.reset()
        start = time.perf_counter()
        compiled_tokens = generate(1 + steps, **static)  # compiles (and records the CUDA graphs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        if getattr(model, "_compiled_call", None) is None:
            raise RuntimeError("generate did not compile the decoding step (static cache refused?)")
        eager_tokens = generate(1 + steps)  # dynamic cache, no compilation: the tokens to match
        tok_s = []
        for _ in range(reps):
            long = clock(lambda: generate(1 + steps, **static))
            short = clock(lambda: generate(1, **static))
            tok_s.append(batch * steps / max(long - short, 1e-9))
    same = compiled_tokens.shape == eager_tokens.shape and bool((compiled_tokens == eager_tokens).all())
    return dict(compile_s=compile_s, tok_s=tok_s, tokens_equal_eager=same)


def run_pair_compiled(name: str, args, device, log, deadline: float, save) -> dict:
    """--compiled-decode: each decode batch in turn, SwitchHead then dense; a batch the time left cannot hold (judged
    from the last one) is not started, and `save` gets the pair so far after each batch (a run stopped at a hard
    limit keeps the batches it finished)."""
    smoke = args.cpu_smoke
    (moe_preset, moe_over), (dense_preset, dense_over) = PAIRS[name]
    clock = Clock(device)
    models = {"switchhead": build(moe_preset, moe_over, device, smoke, args.attn, args.experts_implementation),
              "dense": build(dense_preset, dense_over, device, smoke, args.attn)}
    result = dict(pair=name, presets={"switchhead": moe_preset, "dense": dense_preset}, batch=None, context=None,
                  compiled_decode=True, dtype="bfloat16 weights",
                  mode="reduce-overhead" if device.type == "cuda" else "default",
                  parameters={k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
                  experts_implementation=models["switchhead"].config._experts_implementation, samples={},
                  compile_s={}, tokens_equal_eager={}, not_run=[])
    last = 0.0
    for number, decode_batch in enumerate(args.decode_batches):
        started = time.perf_counter()
        if started + last > deadline:
            result["not_run"] = [f"b{b}" for b in args.decode_batches[number:]]
            log(f"{name}: out of time, decode batches {', '.join(result['not_run'])} not run")
            break
        for kind, model in models.items():
            key = f"{kind}/b{decode_batch}"
            try:
                measured = compiled_decode(model, decode_batch, args.prompt, args.decode_steps, device, clock,
                                           args.reps)
            except Exception as error:  # noqa: BLE001 (recorded; the other measurements go on)
                result.setdefault("errors", {})[f"compiled_decode/{key}"] = f"{type(error).__name__}: " + \
                    (str(error).splitlines() or [""])[0][:300]
                continue
            result["samples"][f"decode_tok_s/{key}"] = measured["tok_s"]
            result["compile_s"][key] = measured["compile_s"]
            result["tokens_equal_eager"][key] = measured["tokens_equal_eager"]
            log(f"{name}: compiled decode {key}: {statistics.median(measured['tok_s']):.1f} tokens/s "
                f"(compiled in {measured['compile_s']:.0f} s)")
        last = time.perf_counter() - started
        summarize_compiled(result, args.decode_batches)
        save(result)
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize_compiled(result, args.decode_batches)


def summarize_compiled(result: dict, decode_batches) -> dict:
    """Medians of the samples, and SwitchHead / dense per decode batch measured for both."""
    medians = {key: statistics.median(values) for key, values in result["samples"].items()}
    result["medians"] = medians
    result["ratios"] = {}
    for decode_batch in decode_batches:
        moe, dense = (medians.get(f"decode_tok_s/{k}/b{decode_batch}") for k in ("switchhead", "dense"))
        if moe is not None and dense:
            result["ratios"][f"decode_tok_s@b{decode_batch}"] = moe / dense
    return result


# ------------------------------------------------------------------------------------------------ driver
def run_pair(name: str, args, device, log) -> dict:
    smoke = args.cpu_smoke
    (moe_preset, moe_over), (dense_preset, dense_over) = PAIRS[name]
    context = 32 if smoke else PAPER_TRAINING[moe_preset]["context"]
    batch = 2 if smoke else (args.batch or PAPER_TRAINING[moe_preset]["batch_size"])
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    clock = Clock(device)
    models = {"switchhead": build(moe_preset, moe_over, device, smoke, args.attn, args.experts_implementation),
              "dense": build(dense_preset, dense_over, device, smoke, args.attn)}
    result = dict(pair=name, presets={"switchhead": moe_preset, "dense": dense_preset}, batch=batch, context=context,
                  parameters={k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
                  experts_implementation=models["switchhead"].config._experts_implementation, samples={})
    samples = result["samples"]

    def add(key, value):
        samples.setdefault(key, []).append(value)

    trainers = {}
    for kind, model in models.items():
        try:
            trainers[kind] = Trainer(model, batch, context, device, autocast_dtype)
            trainers[kind].step()  # warm-up (and the optimizer state exists from here on)
            result.setdefault("train_peak_bytes", {})[kind] = trainers[kind].peak_bytes()
        except torch.OutOfMemoryError as error:
            result.setdefault("errors", {})[f"train/{kind}"] = f"out of memory: {str(error).splitlines()[0]}"
            trainers.pop(kind, None)
            torch.cuda.empty_cache()
    for kind, model in models.items():  # warm-up of the inference paths
        prefill_and_decode(model, 1, min(args.prompt, context), 1, device, autocast_dtype, clock)
    for rep in range(args.reps):
        for kind in trainers:
            add(f"train_s/{kind}", statistics.median(clock(trainers[kind].step) for _ in range(args.train_steps)))
        for kind, model in models.items():
            prefill_s, _, kv_bytes = prefill_and_decode(model, 1, context, 0, device, autocast_dtype, clock)
            add(f"prefill_s/{kind}", prefill_s)
            result.setdefault("kv_cache_bytes", {})[kind] = kv_bytes
            for decode_batch in args.decode_batches:
                _, decode_s, _ = prefill_and_decode(model, decode_batch, args.prompt, args.decode_steps, device,
                                                    autocast_dtype, clock)
                add(f"decode_tok_s/{kind}/b{decode_batch}", decode_batch * args.decode_steps / decode_s)
        log(f"{name}: repetition {rep + 1}/{args.reps}")
    del trainers, models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    medians = {key: statistics.median(values) for key, values in samples.items()}
    result["medians"] = medians

    def ratio(a, b):
        return a / b if a is not None and b else None

    ratios = {"train_time": ratio(medians.get("train_s/switchhead"), medians.get("train_s/dense")),
              "train_peak_memory": ratio(*(result.get("train_peak_bytes", {}).get(k) for k in ("switchhead", "dense"))),
              "prefill_time": ratio(medians["prefill_s/switchhead"], medians["prefill_s/dense"]),
              "kv_cache_bytes": ratio(result["kv_cache_bytes"]["switchhead"], result["kv_cache_bytes"]["dense"])}
    for decode_batch in args.decode_batches:
        ratios[f"decode_tok_s@b{decode_batch}"] = ratio(medians[f"decode_tok_s/switchhead/b{decode_batch}"],
                                                        medians[f"decode_tok_s/dense/b{decode_batch}"])
    result["ratios"] = ratios
    return result


def target_verdict(pair: str, measure: str, value, smoke: bool) -> str:
    if smoke or measure not in TARGETS or value is None or TARGETS[measure][2] not in pair or pair.startswith("moeut"):
        return ""  # the targets are SwitchHead's
    sign, bound, _ = TARGETS[measure]
    met = value <= bound if sign == "<=" else value >= bound
    return f" ({'met' if met else 'missed'}: target {sign} {bound})"


def precision(report: dict) -> str:
    if report.get("settings", {}).get("compiled_decode"):
        return "bf16 weights"
    return "bf16 autocast" if report["environment"]["device_type"] == "cuda" else "fp32"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# End-to-end benchmark ({'CPU smoke' if report['smoke'] else env['device']})", "",
             f"Device: {env['device']}; driver {env.get('driver')}; CUDA {env.get('cuda')}; torch {env['torch']}; "
             f"triton {env['triton']}; transformers {env['transformers']}; attention {report['attn']}; SwitchHead's "
             f"experts {', '.join(sorted({p.get('experts_implementation', '?') for p in report['pairs']})) or '-'} "
             f"(asked: {report.get('experts_implementation', 'auto')}); "
             f"{precision(report)}; medians of {report['reps']} "
             f"interleaved repetitions. Paper: {PAPER}.", "",
             *(["Compiled decoding: `generate` with a static cache and its compiled decoding step (fullgraph; "
                "CUDA graphs on a GPU), bf16 weights (no autocast), after a prompt of "
                f"{report['settings']['prompt']} tokens; training and prefill not timed.", ""]
               if report.get("settings", {}).get("compiled_decode") else []),
             "## Ratios (SwitchHead / dense; time and memory: lower is better, tokens/s: higher)", ""]
    pairs = report["pairs"]
    measures = list(dict.fromkeys(m for p in pairs for m in p["ratios"]))
    lines += ["| measure | " + " | ".join(p["pair"] for p in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    for measure in measures:
        cells = []
        for p in pairs:
            value = p["ratios"].get(measure)
            verdict = target_verdict(p["pair"], measure, value, report["smoke"])
            cells.append("-" if value is None else f"{value:.2f}{verdict}")
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    lines += ["", "## Absolute values", "", "| pair | batch x context | parameters (SwitchHead / dense) | measure | "
              "SwitchHead | dense |", "|---|---|---|---|---|---|"]
    for p in pairs:
        params = f"{p['parameters']['switchhead'] / 1e6:.1f}M / {p['parameters']['dense'] / 1e6:.1f}M"
        rows = [(key.split("/", 1)[0] + ("/" + key.split("/")[2] if key.count("/") == 2 else ""),
                 key.split("/")[1], value) for key, value in p["medians"].items()]
        merged = {}
        for measure, kind, value in rows:
            merged.setdefault(measure, {})[kind] = value
        for kind in ("switchhead", "dense"):
            peak = p.get("train_peak_bytes", {}).get(kind)
            if peak is not None:
                merged.setdefault("train_peak_GiB", {})[kind] = peak / 2 ** 30
        for kind, value in p.get("kv_cache_bytes", {}).items():
            merged.setdefault("kv_cache_MiB", {})[kind] = value / 2 ** 20
        for measure, values in merged.items():
            shape = f"{p['batch']} x {p['context']}" if p.get("batch") else "-"
            lines.append(f"| {p['pair']} | {shape} | {params} | {measure} | "
                         f"{values.get('switchhead', math.nan):.4g} | {values.get('dense', math.nan):.4g} |")
        for key, seconds in p.get("compile_s", {}).items():
            same = p.get("tokens_equal_eager", {}).get(key)
            lines.append(f"| {p['pair']} | - | {params} | compile seconds, {key} (tokens equal the eager loop's: "
                         f"{'yes' if same else 'no'}) | {seconds:.1f} | |")
        for where, error in p.get("errors", {}).items():
            lines.append(f"| {p['pair']} | | | {where} | {error} | |")
    if report.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(report['not_run'])}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: error: no CUDA device; run with --cpu-smoke for the small CPU run", file=sys.stderr)
        return 2
    names = [n for n in PAIRS if args.only in n]
    if not names:
        print(f"bench_e2e: error: --only {args.only!r} matches none of {', '.join(PAIRS)}", file=sys.stderr)
        return 2
    env = describe(device)
    slug = "".join(c if c.isalnum() else "-" for c in env["device"].lower()).strip("-")[:40]
    path = args.out_dir / f"{args.name or 'e2e_' + ('smoke_' if args.cpu_smoke else '') + slug}.json"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(environment=env, smoke=args.cpu_smoke, attn=args.attn, reps=args.reps,
                  experts_implementation=args.experts_implementation or "auto",
                  settings=dict(train_steps=args.train_steps, decode_batches=args.decode_batches, prompt=args.prompt,
                                decode_steps=args.decode_steps, compiled_decode=args.compiled_decode),
                  pairs=[], not_run=[])

    def log(line):
        print(line, flush=True)

    def save(pair=None):  # after every pair (and every compiled batch): a run cut short keeps what it measured
        saved = dict(report, pairs=report["pairs"] + ([pair] if pair is not None else []))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        os.replace(tmp, path)
        if not args.no_markdown:
            path.with_suffix(".md").write_text(markdown(saved))

    begun = time.perf_counter()
    deadline = begun + args.time_budget if args.time_budget else math.inf
    for number, name in enumerate(names):
        started = time.perf_counter()
        # a 262M pair costs several 47M ones: judge from the most expensive pair run so far, scaled by size
        spent = [p["seconds"] * (4 if "262m" in name and "262m" not in p["pair"] else 1) for p in report["pairs"]]
        if started + max(spent, default=0.0) > deadline:
            report["not_run"] += names[number:]
            log(f"out of time: {', '.join(names[number:])} not run")
            break
        report["pairs"].append(run_pair_compiled(name, args, device, log, deadline, save) if args.compiled_decode
                               else run_pair(name, args, device, log))
        report["pairs"][-1]["seconds"] = time.perf_counter() - started
        save()
        log(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in report["pairs"][-1]["ratios"].items() if v is not None))
    if not report["pairs"]:
        path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}" + ("" if args.no_markdown else f" and {path.with_suffix('.md').name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
