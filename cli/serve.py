"""`switchhead serve CHECKPOINT`: check the arguments, then run `switchhead.serving.serve` (Transformers' server),
or with `--engine vllm` vLLM's OpenAI-compatible server (`vllm serve`, our model from the `switchhead.vllm` plugin).

Refused in one line (exit code 2) before the server starts: a folder without config.json, a name that is neither
a folder nor a Hub id, an '@' in the path (the server reads it as a revision), a port out of range or taken,
paged-cache sizes below 1 or past the machine's memory, a `--device` the machine does not have, a folder that
`switchhead.integrity.check_saved_model` refuses (a manifest that does not verify unless `--no-verify`, pickled or
missing weights, weights that do not fit config.json, NaN weights: as generate and eval refuse them), missing
serving dependencies; with `--engine vllm`: vLLM not installed, options only Transformers' server has,
`--vllm-args` that do not parse. A Hub id gets the same checks on the snapshot the local Hub cache holds for it (an
id not in the cache is refused) and is then loaded offline; a generation_config.json asking for a decoding method
Transformers runs only as Hub code (contrastive search, DoLa, group beam search) is refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import socket
import sys

from switchhead import install_command

from .common import check_device, fail


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a checkpoint with Transformers' OpenAI-compatible server",
        description="Run `transformers serve` (its FastAPI app and continuous-batching manager) on a SwitchHead "
                    "checkpoint: /v1/completions, /v1/chat/completions, /v1/models, /health. Requests name the "
                    "model by the CHECKPOINT string. Needs the [serve] extra: "
                    f"`{install_command('serve')}`.")
    parser.add_argument("checkpoint", help="a save_pretrained folder or a Hub model id")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    parser.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=True,
                        help="paged KV cache and continuous batching (default on; --no-continuous-batching: "
                             "one generate() call per request)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load the checkpoint's own modeling code (auto_map), as for a Hub folder")
    parser.add_argument("--attn-implementation", default=None, help="eager, sdpa or flex_attention")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0 or auto (default cpu)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--log-level", default="warning", type=str.lower, choices=LOG_LEVELS,
                        help="Transformers log level (default warning)")
    parser.add_argument("--default-seed", type=int, default=None, help="torch seed at start")
    parser.add_argument("--enable-cors", action="store_true", help="permissive CORS")
    parser.add_argument("--no-verify", action="store_true",
                        help="serve a training run's folder even when its SHA-256 manifest does not verify")
    parser.add_argument("--cb-block-size", type=int, default=None, help="paged-cache block size in tokens")
    parser.add_argument("--cb-num-blocks", type=int, default=None, help="paged-cache blocks")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None, help="tokens per batch at most")
    parser.add_argument("--cb-max-memory-percent", type=float, default=None,
                        help="share of free accelerator memory for the paged cache (0-1)")
    parser.add_argument("--engine", choices=ENGINES, default="transformers",
                        help="transformers (default: Transformers' server) or vllm (vLLM's server with the "
                             "switchhead.vllm plugin; needs vLLM installed, e.g. `bash scripts/vllm.sh`)")
    parser.add_argument("--vllm-args", default="",
                        help="with --engine vllm: more `vllm serve` options, one quoted string "
                             "(e.g. \"--max-model-len 1024 --max-num-seqs 64\")")
    parser.set_defaults(handler=run)


ENGINES = ("transformers", "vllm")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_CB_BLOCK_SIZE = 1 << 16  # tokens per paged-cache block; a larger block is a typo (the cache is blocks x size)
# options of Transformers' server that `vllm serve` has no equivalent for: refused with --engine vllm, not ignored
TRANSFORMERS_ONLY = {"continuous_batching": ("--no-continuous-batching", True), "attn_implementation": (None, None),
                     "cb_block_size": (None, None), "cb_num_blocks": (None, None), "cb_max_batch_tokens": (None, None),
                     "cb_max_memory_percent": (None, None), "enable_cors": (None, False)}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_command(args) -> list[str]:
    """The `vllm serve` command line for these arguments (the `vllm` console script's module, this Python)."""
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.checkpoint, "--host", args.host,
               "--port", str(args.port), "--dtype", args.dtype]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    if args.default_seed is not None:
        command += ["--seed", str(args.default_seed)]
    try:
        command += shlex.split(args.vllm_args)
    except ValueError as error:
        fail(f"--vllm-args does not parse ({error}): give the options as one quoted string")
    return command


def run_vllm(args) -> int:
    """Replace this process by `vllm serve` (signals and the exit code are vLLM's own)."""
    for name, (flag, default) in TRANSFORMERS_ONLY.items():
        if getattr(args, name) != default:
            fail(f"{flag or '--' + name.replace('_', '-')} is an option of Transformers' server; with --engine vllm "
                 f"give vLLM's options with --vllm-args")
    if not vllm_available():
        fail("--engine vllm needs vLLM, which is not installed in this environment: `bash scripts/vllm.sh` builds "
             ".venv-vllm with it (then .venv-vllm/bin/switchhead serve ... --engine vllm); the default "
             "--engine transformers needs no vLLM")
    command = vllm_command(args)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": args.log_level.upper()}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)
    return 0  # not reached


def paged_cache_bytes(config, blocks: int, block_size: int | None) -> int:
    """Bytes of a paged KV cache of `blocks` blocks (K and V of every layer and head, fp32 at most)."""
    from switchhead.serving import DEFAULT_CB_BLOCK_SIZE

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return blocks * (block_size or DEFAULT_CB_BLOCK_SIZE) * config.num_hidden_layers * 2 * heads * head_dim * 4


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def run(args) -> int:
    checkpoint = args.checkpoint
    if args.engine == "vllm" and args.device not in ("cpu", "auto"):
        fail(f"--device {args.device} is not passed to vLLM, which picks its own platform; leave --device out "
             f"with --engine vllm")
    if os.path.exists(checkpoint):
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            fail(f"{checkpoint!r} has no config.json; pass a save_pretrained folder or a Hub model id")
    elif not HUB_ID.match(checkpoint):
        fail(f"checkpoint {checkpoint!r} is neither an existing folder nor a Hub id (owner/name)")
    if "@" in checkpoint:
        fail(f"checkpoint {checkpoint!r} contains '@', which the server reads as a revision; rename or move the "
             "folder")
    if not 0 < args.port < 65536:
        fail(f"--port must be in 1..65535, got {args.port}")
    for flag in ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.cb_block_size is not None and args.cb_block_size > MAX_CB_BLOCK_SIZE:
        fail(f"--cb-block-size must be <= {MAX_CB_BLOCK_SIZE} tokens, got {args.cb_block_size}")
    if args.cb_max_memory_percent is not None and not 0 < args.cb_max_memory_percent <= 1:
        fail(f"--cb-max-memory-percent must be in (0, 1], got {args.cb_max_memory_percent}")
    if args.device != "auto":
        check_device(args.device)
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: connections of an earlier server still in TIME_WAIT do not make the port taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as error:
            fail(f"cannot listen on {args.host}:{args.port} ({error.strerror}); pick another --port or --host")
    from switchhead.integrity import check_fits_memory, check_saved_model
    from switchhead.integrity.loading import check_hub_model, hub_offline, read_config

    # last, as it reads every tensor; as generate and eval: the manifest (unless --no-verify), safetensors
    # weights only, sizes within memory, weights that fit config.json, finite values (Transformers would load
    # a damaged folder and serve garbage). A Hub id gets the same checks on the cached snapshot it resolves to,
    # and is then loaded offline, so that the snapshot served is the one checked.
    folder = checkpoint
    if not os.path.isdir(checkpoint):
        folder, _ = check_hub_model(checkpoint, verify=not args.no_verify, trust_remote_code=args.trust_remote_code)
        hub_offline()
    else:
        check_saved_model(checkpoint, verify=not args.no_verify, trust_remote_code=args.trust_remote_code)
    from switchhead.integrity.loading import check_decoding_method

    check_decoding_method(folder)  # else every request would fail with HTTP 500
    if args.cb_num_blocks is not None and args.continuous_batching:
        cache = paged_cache_bytes(read_config(folder, args.trust_remote_code), args.cb_num_blocks,
                                  args.cb_block_size)
        check_fits_memory(cache, f"--cb-num-blocks {args.cb_num_blocks}: the paged KV cache")
    elif args.cb_block_size is not None and args.continuous_batching and str(args.device).startswith("cpu"):
        from switchhead.serving import CPU_CACHE_BLOCKS  # the blocks a CPU server gets when none are given

        cache = paged_cache_bytes(read_config(folder), CPU_CACHE_BLOCKS, args.cb_block_size)
        check_fits_memory(cache, f"--cb-block-size {args.cb_block_size}: the paged KV cache of "
                                 f"{CPU_CACHE_BLOCKS} blocks")
    if args.engine == "vllm":
        return run_vllm(args)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        fail(f"serving needs fastapi, uvicorn and openai (the [serve] extra): {install_command('serve')}")
    from switchhead.serving import SERVE_DEFAULTS, serve
    from switchhead.serving.server import check_upstream_server

    try:
        check_upstream_server()
    except ImportError as error:
        fail(str(error))

    options = {name: getattr(args, name) for name in SERVE_DEFAULTS}
    try:
        serve(checkpoint, host=args.host, port=args.port, **options)
    except (OSError, ValueError, ImportError) as error:  # the checkpoint could not be loaded, the port is taken, ...
        fail(f"cannot serve {checkpoint!r}: {str(error).splitlines()[0] if str(error) else error!r}")
    return 0
