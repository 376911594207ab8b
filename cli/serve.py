"""`switchhead serve CHECKPOINT`: check the arguments, then run `switchhead.serving.serve` (Transformers' server).

Refused in one line (exit code 2) before the server starts: a folder without config.json, a name that is neither
a folder nor a Hub id, an '@' in the path (the server reads it as a revision), a port out of range or taken,
paged-cache sizes below 1, weights that do not fit config.json, missing serving dependencies.
"""

from __future__ import annotations

import argparse
import os
import re
import socket

from . import fail


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a checkpoint with Transformers' OpenAI-compatible server",
        description="Run `transformers serve` (its FastAPI app and continuous-batching manager) on a SwitchHead "
                    "checkpoint: /v1/completions, /v1/chat/completions, /v1/models, /health. Requests name the "
                    "model by the CHECKPOINT string. Needs `pip install switchhead[serve]`.")
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
    parser.add_argument("--log-level", default="warning", help="Transformers log level (default warning)")
    parser.add_argument("--default-seed", type=int, default=None, help="torch seed at start")
    parser.add_argument("--enable-cors", action="store_true", help="permissive CORS")
    parser.add_argument("--cb-block-size", type=int, default=None, help="paged-cache block size in tokens")
    parser.add_argument("--cb-num-blocks", type=int, default=None, help="paged-cache blocks")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None, help="tokens per batch at most")
    parser.add_argument("--cb-max-memory-percent", type=float, default=None,
                        help="share of free accelerator memory for the paged cache (0-1)")
    parser.set_defaults(handler=run)


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def run(args) -> int:
    checkpoint = args.checkpoint
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
    if args.cb_max_memory_percent is not None and not 0 < args.cb_max_memory_percent <= 1:
        fail(f"--cb-max-memory-percent must be in (0, 1], got {args.cb_max_memory_percent}")
    if os.path.isdir(checkpoint):
        from switchhead.integrity import weight_shape_problem

        problem = weight_shape_problem(checkpoint)  # Transformers would print a load report and a traceback
        if problem is not None:
            fail(f"cannot serve {checkpoint!r}: {problem}")
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: connections of an earlier server still in TIME_WAIT do not make the port taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as error:
            fail(f"cannot listen on {args.host}:{args.port} ({error.strerror}); pick another --port or --host")
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        fail("serving needs fastapi, uvicorn and openai: pip install 'switchhead[serve]'")
    from switchhead.serving import SERVE_DEFAULTS, serve

    options = {name: getattr(args, name) for name in SERVE_DEFAULTS}
    try:
        serve(checkpoint, host=args.host, port=args.port, **options)
    except (OSError, ValueError, ImportError) as error:  # the checkpoint could not be loaded, the port is taken, ...
        fail(f"cannot serve {checkpoint!r}: {str(error).splitlines()[0] if str(error) else error!r}")
    return 0
