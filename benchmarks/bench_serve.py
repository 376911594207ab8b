"""Serving benchmark: SwitchHead vs its parameter-matched dense baseline, through continuous batching and the server.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_serve.py [--new-tokens 16] [--prompt-tokens 32] [--quick]

For each model pair (47M RoPE: wt103-45m-switchhead-rope vs the dense 47M baseline with RoPE positions; 47M XL:
wt103-47m-switchhead-xl vs wt103-47m-dense-xl), randomly initialised (speed does not depend on the weights), it
measures, with the models interleaved in one run:

1. generated tokens/s and p50/p95 request latency at 1, 8 and 32 concurrent requests through `generate_batch`
   (Transformers' continuous batching, paged cache) -- latency is each request's lifespan inside the manager;
2. the same through the real server (`switchhead serve` subprocess, `openai` client, one thread per request);
3. the most concurrent sequences of `--context` tokens that fit a fixed KV-cache budget, from the paged cache's own
   bytes per block (`PagedAttentionCache`, the cache Transformers allocates for the model).

Every request has the same prompt length and generates exactly `--new-tokens` tokens (no end-of-sequence token).
Prints tables and writes JSON + Markdown to benchmarks/results/ naming the machine, CPU, threads and torch version.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.evaluation.accounting import kv_cache_bytes_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAIRS = {
    "47M RoPE": ("wt103-45m-switchhead-rope", ("wt103-47m-dense-xl", {"position_encoding": "rope", "xl_memory_length": 0})),
    "47M XL": ("wt103-47m-switchhead-xl", ("wt103-47m-dense-xl", {})),
}
CONCURRENCY = (1, 8, 32)
CACHE_BUDGET_MB = 256


def build_config(spec) -> SwitchHeadConfig:
    name, overrides = (spec, {}) if isinstance(spec, str) else spec
    return SwitchHeadConfig.from_preset(name, eos_token_id=None, bos_token_id=None, pad_token_id=0, **overrides)


def label(spec) -> str:
    name, overrides = (spec, {}) if isinstance(spec, str) else spec
    return name + "".join(f" ({k}={v})" for k, v in overrides.items())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def cb_config(args=None, **fields):
    """Transformers' ContinuousBatchingConfig (`page_size` was `block_size` up to Transformers 5.17, the GPU's)."""
    from transformers import ContinuousBatchingConfig

    fields = fields or dict(num_blocks=args.cb_blocks, page_size=64, max_batch_tokens=args.max_batch_tokens)
    if "page_size" not in inspect.signature(ContinuousBatchingConfig).parameters:
        fields["block_size"] = fields.pop("page_size")
    return ContinuousBatchingConfig(**fields)


def resolved_cb_config(config, cb):
    """Transformers' `resolve_continuous_batching_config` on the CPU (its `device` argument arrived after 5.17)."""
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

    if "device" in inspect.signature(resolve_continuous_batching_config).parameters:
        return resolve_continuous_batching_config(config, cb, None, False, torch.device("cpu"))
    return resolve_continuous_batching_config(config, cb, None, False)


def bench_generate_batch(model, concurrency: int, args) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    inputs = prompts(concurrency, args.prompt_tokens, model.config.vocab_size, seed=concurrency)
    start = time.perf_counter()
    results = model.generate_batch(inputs=inputs, generation_config=config, continuous_batching_config=cb_config(args),
                                   warmup=False)
    wall = time.perf_counter() - start
    tokens = sum(len(out.generated_tokens) for out in results.values())
    latencies = [out.lifespan[1] - out.lifespan[0] for out in results.values()]
    return {"tokens_per_s": tokens / wall, "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "wall_s": wall, "tokens": tokens}


# ---------------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def save_checkpoint(model, folder: Path) -> None:
    """The model plus a word-level tokenizer over its vocabulary ("w0".."wN"), so prompts map to known ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0")
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class Server:
    def __init__(self, folder: Path, args):
        self.folder, self.port = str(folder), free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-c", "import sys; from switchhead.cli import main; sys.exit(main())", "serve",
                   self.folder, "--port", str(self.port), "--cb-num-blocks", str(args.cb_blocks),
                   "--cb-max-batch-tokens", str(args.max_batch_tokens)]
        self.log = open(folder / "server.log", "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: see {folder / 'server.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        import openai

        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                                    timeout=600)

    def request(self, prompt: str, new_tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        response = self.client.completions.create(model=self.folder, prompt=prompt, max_tokens=new_tokens,
                                                  temperature=0)
        return time.perf_counter() - start, response.usage.completion_tokens

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def bench_server(server: Server, vocab: int, concurrency: int, args) -> dict:
    texts = [" ".join(f"w{i}" for i in ids) for ids in prompts(concurrency, args.prompt_tokens, vocab, concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda text: server.request(text, args.new_tokens), texts))
    wall = time.perf_counter() - start
    latencies = [latency for latency, _ in answers]
    tokens = sum(count for _, count in answers)
    return {"tokens_per_s": tokens / wall, "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
            "wall_s": wall, "tokens": tokens}


# ---------------------------------------------------------------------------------------------------- capacity
def cache_capacity(config: SwitchHeadConfig, context: int, budget_bytes: int) -> dict:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    page = 64
    cb = resolved_cb_config(config, cb_config(num_blocks=1, page_size=page, max_batch_tokens=page))
    cache = PagedAttentionCache(config, cb, "cpu", DistributedHelper(None, None), dtype=torch.float32)
    allocator = next(iter(cache.cache_allocators.values()))
    bytes_per_block = allocator.bytes_per_block  # one page of `page` tokens for every layer
    blocks = budget_bytes // bytes_per_block
    blocks_per_sequence = -(-context // page)
    return {"bytes_per_token": bytes_per_block // page, "accounting_bytes_per_token":
            kv_cache_bytes_per_token(config, "float32"), "sequences": blocks // blocks_per_sequence}


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512, help="sequence length for the cache-capacity count")
    parser.add_argument("--cb-blocks", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--no-server", action="store_true", help="only generate_batch and the cache capacity")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8 only, 8 new tokens")
    parser.add_argument("--under-load", default="", help="say what else ran on the machine (goes in the results)")
    args = parser.parse_args(argv)
    concurrency = (1, 8) if args.quick else CONCURRENCY
    if args.quick:
        args.new_tokens = min(args.new_tokens, 8)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    models, rows = {}, []
    for pair, (switchhead_spec, dense_spec) in PAIRS.items():
        for kind, spec in (("switchhead", switchhead_spec), ("dense", dense_spec)):
            torch.manual_seed(0)
            config = build_config(spec)
            models[(pair, kind)] = (label(spec), SwitchHeadForCausalLM(config).eval())

    results: dict = {"generate_batch": {}, "server": {}, "capacity": {}}
    # interleaved: for each concurrency level, every model in turn
    for level in concurrency:
        for (pair, kind), (name, model) in models.items():
            with torch.no_grad():
                row = bench_generate_batch(model, level, args)
            results["generate_batch"].setdefault(pair, {}).setdefault(kind, {})[level] = row
            print(f"generate_batch {pair:9s} {kind:10s} x{level:<3d} {row['tokens_per_s']:8.1f} tok/s  "
                  f"p50 {row['p50_s']:.2f}s  p95 {row['p95_s']:.2f}s", flush=True)

    if not args.no_server:
        with tempfile.TemporaryDirectory() as scratch:
            servers = {}
            try:
                for (pair, kind), (name, model) in models.items():
                    folder = Path(scratch) / f"{pair.replace(' ', '-')}-{kind}"
                    save_checkpoint(model, folder)
                    servers[(pair, kind)] = Server(folder, args)
                for server, (_, model) in zip(servers.values(), models.values()):  # first request: paged cache setup
                    server.request("w1 w2", 1)
                for level in concurrency:
                    for (pair, kind), server in servers.items():
                        row = bench_server(server, models[(pair, kind)][1].config.vocab_size, level, args)
                        results["server"].setdefault(pair, {}).setdefault(kind, {})[level] = row
                        print(f"server         {pair:9s} {kind:10s} x{level:<3d} {row['tokens_per_s']:8.1f} tok/s  "
                              f"p50 {row['p50_s']:.2f}s  p95 {row['p95_s']:.2f}s", flush=True)
            finally:
                for server in servers.values():
                    server.stop()

    budget = CACHE_BUDGET_MB * 2**20
    for (pair, kind), (name, model) in models.items():
        context = args.context  # the same sequence length for both models of a pair
        results["capacity"].setdefault(pair, {})[kind] = {"context": context, **cache_capacity(model.config, context,
                                                                                                 budget)}

    ratios = {}
    for pair in PAIRS:
        entry = {}
        for path in ("generate_batch", "server"):
            if pair in results[path]:
                entry[f"{path}_tokens_per_s_ratio"] = {
                    level: results[path][pair]["switchhead"][level]["tokens_per_s"]
                    / results[path][pair]["dense"][level]["tokens_per_s"] for level in concurrency}
        capacity = results["capacity"][pair]
        entry["sequences_ratio"] = capacity["switchhead"]["sequences"] / capacity["dense"]["sequences"]
        ratios[pair] = entry

    machine = {"machine": platform.node(), "cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "under_load": args.under_load,
               "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "cache_budget_mb": CACHE_BUDGET_MB,
               "models": {f"{pair} {kind}": name for (pair, kind), (name, _) in models.items()},
               "seconds": round(time.perf_counter() - started, 1)}
    report = {"machine": machine, "results": results, "ratios": ratios}

    lines = [f"# bench_serve: {machine['cpu']}, {args.threads} threads, torch {machine['torch']}",
             f"machine `{machine['machine']}`; {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each; "
             f"load: {args.under_load or 'not stated'}; took {machine['seconds']} s", "",
             "| pair | path | concurrency | SwitchHead tok/s | dense tok/s | ratio | SwitchHead p50/p95 s | "
             "dense p50/p95 s |", "|---|---|---|---|---|---|---|---|"]
    for pair in PAIRS:
        for path in ("generate_batch", "server"):
            if pair not in results[path]:
                continue
            for level in concurrency:
                s, d = results[path][pair]["switchhead"][level], results[path][pair]["dense"][level]
                lines.append(f"| {pair} | {path} | {level} | {s['tokens_per_s']:.1f} | {d['tokens_per_s']:.1f} | "
                             f"{s['tokens_per_s'] / d['tokens_per_s']:.2f}x | {s['p50_s']:.2f}/{s['p95_s']:.2f} | "
                             f"{d['p50_s']:.2f}/{d['p95_s']:.2f} |")
    lines += ["", f"Concurrent sequences of {args.context} tokens in a {CACHE_BUDGET_MB} MiB fp32 paged KV cache:", "",
              "| pair | SwitchHead bytes/token | dense bytes/token | SwitchHead sequences | dense sequences | ratio |",
              "|---|---|---|---|---|---|"]
    for pair in PAIRS:
        s, d = results["capacity"][pair]["switchhead"], results["capacity"][pair]["dense"]
        lines.append(f"| {pair} | {s['bytes_per_token']} | {d['bytes_per_token']} | {s['sequences']} | "
                     f"{d['sequences']} | {s['sequences'] / d['sequences']:.2f}x |")
    markdown = "\n".join(lines) + "\n"
    print("\n" + markdown)
    RESULTS.mkdir(exist_ok=True)
    stem = "serve_cpu_" + "".join(c if c.isalnum() else "-" for c in machine["cpu"].lower())[:40].strip("-")
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(f"wrote {RESULTS / (stem + '.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
