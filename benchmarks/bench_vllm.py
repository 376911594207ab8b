"""vLLM benchmark: the 47M SwitchHead presets against their parameter-matched dense baselines, all on vLLM.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--new-tokens 16] [--prompt-tokens 128,1024]
                                                    [--concurrency 1,8,32,64] [--kv-cache-gib 1] [--repeats 3]

Runs in the vLLM environment (`bash scripts/vllm.sh`). Models (random weights: speed does not depend on them; 8000
tokens; max_position_embeddings raised to 2048 so 1024-token prompts fit): 47M RoPE = wt103-45m-switchhead-rope
against wt103-47m-dense-xl with RoPE positions, 47M XL = wt103-47m-switchhead-xl against wt103-47m-dense-xl. Every
model gets its own vLLM engine (the switchhead.vllm plugin, fp32, one KV cache of `--kv-cache-gib` GiB each,
prefix caching off so every prompt is computed), all alive at once, and the measurements interleave the models:

1. for each prompt length and concurrency, `--repeats` times, the models in turn (in the reverse order every other
   time): `c` requests of random prompts (the same for every model and repetition) submitted at once, each generating
   exactly `--new-tokens` tokens; generated tokens/s over the wall time, and p50/p95 of the requests' latencies
   (submission to last token). Each pair's ratio is taken within each repetition; the median and the range
   (min-max) of those ratios are reported;
2. how many concurrent sequences of 1024 tokens fit the same KV cache: vLLM's own block count for the model
   (`cache_config.num_gpu_blocks` x block size / 1024), i.e. what the padded / XL-folded head size costs;
3. vLLM against our `generate_batch` (Transformers' continuous batching, in this process) for the same SwitchHead
   model, 32 requests of 128 tokens.

Writes JSON + Markdown to benchmarks/results/vllm_cpu_<cpu>.json / .md with the machine, its load averages before and
after (the machine is shared: treat single ratios as noisy), threads and versions.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

for _name, _value in dict(VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
                          VLLM_CPU_KVCACHE_SPACE=None).items():
    if _value is not None:
        os.environ.setdefault(_name, _value)

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

DENSE = ("wt103-47m-dense-xl", {})
PAIRS = {
    "47M RoPE": (("wt103-45m-switchhead-rope", {}), ("wt103-47m-dense-xl", {"position_encoding": "rope",
                                                                           "xl_memory_length": 0})),
    "47M XL": (("wt103-47m-switchhead-xl", {}), DENSE),
}
SEQUENCE_TOKENS = 1024


def label(spec) -> str:
    name, overrides = spec
    return name + "".join(f" ({k}={v})" for k, v in overrides.items())


def save_model(spec, folder: Path) -> None:
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    name, overrides = spec
    config = SwitchHeadConfig.from_preset(name, max_position_embeddings=2048, eos_token_id=None, **overrides)
    torch.manual_seed(0)
    SwitchHeadForCausalLM(config).eval().save_pretrained(folder)


def start_engine(folder: Path, max_seqs: int, max_len: int):
    from vllm import LLM

    return LLM(model=str(folder), dtype="float32", max_model_len=max_len, enable_prefix_caching=False,
               max_num_seqs=max_seqs, max_num_batched_tokens=max(2048, max_len), seed=0, enforce_eager=True,
               skip_tokenizer_init=True, distributed_executor_backend="uni")


def run_requests(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit every prompt at once; step the engine until all finish; tokens/s and latency percentiles."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    pending = {}
    for prompt in prompts:
        request_id = uuid.uuid4().hex
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        pending[request_id] = started
    latencies, generated = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                latencies.append(time.perf_counter() - pending.pop(output.request_id))
                generated += len(output.outputs[0].token_ids)
    seconds = time.perf_counter() - started
    latencies.sort()
    return dict(tokens_per_s=generated / seconds, seconds=seconds, generated=generated,
                p50_s=statistics.median(latencies), p95_s=latencies[min(len(latencies) - 1,
                                                                          round(0.95 * (len(latencies) - 1)))])


def sequences_that_fit(llm) -> dict:
    cache = llm.llm_engine.vllm_config.cache_config
    tokens = cache.num_gpu_blocks * cache.block_size
    return dict(cache_tokens=tokens, sequences=tokens // SEQUENCE_TOKENS)


def generate_batch_speed(folder: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """Our Transformers path on the same checkpoint: `generate_batch` (continuous batching, paged cache)."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from switchhead import SwitchHeadForCausalLM

    model = SwitchHeadForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    # a paged cache for these requests (on the CPU Transformers would size it as a share of the whole RAM)
    pages = sum(-(-(len(prompt) + new_tokens) // 64) for prompt in prompts) + 8
    fields = dict(num_blocks=pages, page_size=64, max_batch_tokens=512)
    if "page_size" not in inspect.signature(ContinuousBatchingConfig).parameters:  # `block_size` up to 5.17
        fields["block_size"] = fields.pop("page_size")
    started = time.perf_counter()
    with torch.no_grad():
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                       continuous_batching_config=ContinuousBatchingConfig(**fields))
    seconds = time.perf_counter() - started
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    del model
    gc.collect()
    return dict(tokens_per_s=generated / seconds, seconds=seconds, generated=generated)


def measure(results, engines, folders, cells, new_tokens, generator, pairs, with_generate_batch=True,
            repeats=1) -> None:
    """The interleaved cells, `repeats` times each, then vLLM against generate_batch."""
    import torch

    for length, count in cells:
        prompts = [torch.randint(0, 8000, (length,), generator=generator).tolist() for _ in range(count)]
        for repeat in range(repeats):
            names = list(engines) if repeat % 2 == 0 else list(reversed(engines))  # neither model always first
            for name in names:  # the same prompts for every model and repetition
                cell = run_requests(engines[name], prompts, new_tokens)
                results["speed"].append(dict(model=name, prompt_tokens=length, concurrency=count, repeat=repeat,
                                             **cell))
                print(f"{name:60s} prompt {length:5d} x {count:3d} ({repeat + 1}/{repeats}): "
                      f"{cell['tokens_per_s']:8.1f} tok/s, p50 {cell['p50_s']:.2f} s, p95 {cell['p95_s']:.2f} s",
                      flush=True)
    if not with_generate_batch:
        return
    switchhead = [label(pair[0]) for pair in pairs.values()]
    prompts = [torch.randint(0, 8000, (128,), generator=generator).tolist() for _ in range(32)]
    for name in switchhead:
        via_vllm = run_requests(engines[name], prompts, new_tokens)
        via_transformers = generate_batch_speed(folders[name], prompts, new_tokens)
        results["generate_batch"][name] = dict(vllm=via_vllm, generate_batch=via_transformers,
                                               ratio=via_vllm["tokens_per_s"] / via_transformers["tokens_per_s"])
        print(f"{name}: vLLM {via_vllm['tokens_per_s']:.1f} tok/s, generate_batch "
              f"{via_transformers['tokens_per_s']:.1f} tok/s", flush=True)


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="128,1024")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE for every engine")
    parser.add_argument("--quick", action="store_true", help="one prompt length (128), concurrency 1 and 8")
    parser.add_argument("--cells", default=None,
                        help="only these PROMPTxCONCURRENT cells, e.g. 128x1,1024x8 (default: every combination)")
    parser.add_argument("--no-generate-batch", action="store_true", help="leave out vLLM against generate_batch")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated subset of {list(PAIRS)}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repetitions of every cell, the models interleaved (ratio: median and range)")
    parser.add_argument("--update", action="store_true",
                        help="merge into the existing results file: rows of the models run now replace theirs")
    parser.add_argument("--output", default=None, help="results path without extension")
    args = parser.parse_args()
    pairs = {name: PAIRS[name] for name in args.pairs.split(",")}
    if args.quick:
        args.prompt_tokens, args.concurrency = "128", "1,8"
    prompt_lengths = [int(v) for v in args.prompt_tokens.split(",")]
    concurrency = [int(v) for v in args.concurrency.split(",")]
    cells = [(length, count) for length in prompt_lengths for count in concurrency]
    if args.cells:
        cells = [tuple(int(v) for v in cell.split("x")) for cell in args.cells.split(",")]
        prompt_lengths, concurrency = sorted({c[0] for c in cells}), sorted({c[1] for c in cells})
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"

    import torch
    import transformers
    import vllm

    specs = {label(spec): spec for pair in pairs.values() for spec in pair}
    info = dict(machine=platform.node(), cpu=cpu_name(), cpu_count=os.cpu_count(), torch=torch.__version__,
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                transformers=transformers.__version__, vllm=vllm.__version__, dtype="float32",
                kv_cache_gib=args.kv_cache_gib, new_tokens=args.new_tokens, repeats=args.repeats,
                pairs=list(pairs), load_average_before=load_average(),
                note="shared 2-core machine, other work running: single ratios are noisy")
    generator = torch.Generator().manual_seed(0)
    results: dict = dict(info=info, speed=[], capacity={}, generate_batch={})
    max_len = max(prompt_lengths) + args.new_tokens
    with tempfile.TemporaryDirectory() as root:
        folders, engines = {}, {}
        for name, spec in specs.items():
            folders[name] = Path(root) / "".join(c if c.isalnum() else "-" for c in name)  # one per spec
            if not folders[name].exists():
                save_model(spec, folders[name])
        try:
            for name in specs:  # every engine alive, so the measurements can interleave
                print(f"starting {name}", flush=True)
                engines[name] = start_engine(folders[name], max(concurrency), max_len)
                results["capacity"][name] = sequences_that_fit(engines[name])
            measure(results, engines, folders, cells, args.new_tokens, generator, pairs, not args.no_generate_batch,
                    args.repeats)
        finally:
            for engine in engines.values():  # the engine processes end with us, also on an error
                engine.llm_engine.engine_core.shutdown()
    info["load_average_after"] = load_average()
    slug = "".join(c if c.isalnum() else "-" for c in info["cpu"].lower()).strip("-")[:32]
    output = Path(args.output) if args.output else RESULTS / f"vllm_cpu_{slug}"
    if args.update and output.with_suffix(".json").exists():
        results = merged(json.loads(output.with_suffix(".json").read_text()), results, set(specs))
    results["ratios"] = ratio_summary(results)
    output.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(results))
    print(f"wrote {output}.json and .md", flush=True)
    return 0


def merged(old: dict, new: dict, models: set[str]) -> dict:
    """`old` with the cells measured in `new` replaced (and its capacity / generate_batch rows); the run information
    of both kept."""
    measured = {(row["model"], row["prompt_tokens"], row["concurrency"]) for row in new["speed"]}
    speed = [row for row in old["speed"] if (row["model"], row["prompt_tokens"], row["concurrency"]) not in measured]
    speed += new["speed"]
    capacity = {**{k: v for k, v in old["capacity"].items() if k not in models}, **new["capacity"]}
    generate_batch = {**old["generate_batch"], **new["generate_batch"]}
    info = {**old["info"], "updated": {"models": sorted(models), **new["info"]}}
    return dict(info=info, speed=speed, capacity=capacity, generate_batch=generate_batch)


def pairs_in(results: dict) -> list[str]:
    """The pairs of PAIRS that a result measured (either of its models has a row), in PAIRS' order."""
    models = {row["model"] for row in results["speed"]} | set(results["capacity"])
    return [pair for pair, specs in PAIRS.items() if any(label(spec) in models for spec in specs)]


def ratio_summary(results: dict) -> list[dict]:
    """Per pair and cell: SwitchHead / dense tokens/s of each repetition (the i-th run of one model against the i-th
    of the other), their median and range, and each model's median tokens/s and latencies."""
    runs: dict = {}
    for row in results["speed"]:
        runs.setdefault((row["model"], row["prompt_tokens"], row["concurrency"]), []).append(row)
    out = []
    for pair in pairs_in(results):
        ours, dense = (label(spec) for spec in PAIRS[pair])
        for length, count in sorted({(length, count) for model, length, count in runs}):
            a, b = runs.get((ours, length, count)), runs.get((dense, length, count))
            if not a or not b:
                continue
            ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b)]
            medians = [{key: statistics.median(row[key] for row in rows) for key in ("tokens_per_s", "p50_s", "p95_s")}
                       for rows in (a, b)]
            out.append(dict(pair=pair, prompt_tokens=length, concurrency=count, ratios=ratios,
                            median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                            switchhead=medians[0], dense=medians[1]))
    return out


def markdown(results: dict) -> str:
    info = results["info"]
    lines = [f"# vLLM serving benchmark ({info['cpu']}, {info['cpu_count']} cores)", "",
             f"Machine `{info['machine']}`; torch {info['torch']} ({info['torch_threads']} threads, OMP_NUM_THREADS="
             f"{info['omp_num_threads']}), transformers {info['transformers']}, vLLM {info['vllm']}, fp32, "
             f"{info['new_tokens']} new tokens per request, KV cache {info['kv_cache_gib']:g} GiB per engine. "
             f"Load average before {info['load_average_before']}, after {info.get('load_average_after')}: "
             f"{info['note']}."
             + (f" Re-run later for {', '.join(info['updated']['models'])} (load average before "
                f"{info['updated']['load_average_before']}, after {info['updated'].get('load_average_after')})."
                if "updated" in info else "")
             + (f" Correction: {info['correction']}." if "correction" in info else ""), "",
             "## Tokens/s and latency (models interleaved)", "",
             "SwitchHead / dense tokens/s is taken within each repetition; the table gives the median ratio and its "
             "range over the repetitions (n), and the median tokens/s and latencies of each model.", "",
             "| pair | prompt | concurrent | n | ratio (median) | ratio range | SwitchHead tok/s | dense tok/s | "
             "SwitchHead p50 / p95 s | dense p50 / p95 s |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(row["prompt_tokens"], row["concurrency"]) for row in results["speed"]})
    summary = {(row["pair"], row["prompt_tokens"], row["concurrency"]): row for row in ratio_summary(results)}
    for pair in pairs_in(results):
        for length, count in keys:
            row = summary.get((pair, length, count))
            if row is None:
                lines.append(f"| {pair} | {length} | {count} | 0 | not measured | | | | | |")
                continue
            a, b = row["switchhead"], row["dense"]
            lines.append(f"| {pair} | {length} | {count} | {len(row['ratios'])} | {row['median']:.2f}x | "
                         f"{row['min']:.2f}-{row['max']:.2f}x | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                         f"{a['p50_s']:.2f} / {a['p95_s']:.2f} | {b['p50_s']:.2f} / {b['p95_s']:.2f} |")
    lines += ["", f"## Concurrent {SEQUENCE_TOKENS}-token sequences in the same KV cache", "",
              "| pair | SwitchHead | dense | ratio |", "|---|---|---|---|"]
    for pair in pairs_in(results):
        ours, dense = PAIRS[pair]
        if label(ours) not in results["capacity"] or label(dense) not in results["capacity"]:
            continue
        a, b = results["capacity"][label(ours)]["sequences"], results["capacity"][label(dense)]["sequences"]
        lines.append(f"| {pair} | {a} | {b} | {a / max(b, 1):.2f}x |")
    if not results["generate_batch"]:  # --no-generate-batch
        return "\n".join(lines) + "\n"
    lines += ["", "## vLLM against our `generate_batch`, same SwitchHead model, 32 requests of 128 tokens", "",
              "| model | vLLM tok/s | generate_batch tok/s | ratio |", "|---|---|---|---|"]
    for name, row in results["generate_batch"].items():
        lines.append(f"| {name} | {row['vllm']['tokens_per_s']:.1f} | {row['generate_batch']['tokens_per_s']:.1f} | "
                     f"{row['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
