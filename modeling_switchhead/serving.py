"""Serve a SwitchHead checkpoint with Transformers' own OpenAI-compatible server (`transformers serve`).

    switchhead serve CHECKPOINT [--host 127.0.0.1] [--port 8000]      # command line
    from switchhead.serving import serve; serve("path/or/hub-id", port=8000)   # Python

Everything that answers HTTP -- the FastAPI app, `/v1/completions`, `/v1/chat/completions` (streamed or not),
the continuous-batching manager with its paged KV cache -- is Transformers' (`transformers.cli.serve.Serve`).
This module changes exactly one thing: how the model class is found (`SwitchHeadModelManager._load_model`).

Upstream limitation (Transformers 5.23, `transformers/cli/serving/model_manager.py`, `ModelManager._load_model`):
the class is looked up as `getattr(transformers, config.architectures[0])`, so an architecture that is not part of
the `transformers` module -- a third-party package registered with `AutoModelForCausalLM.register`, or remote code
named by `auto_map` -- fails with "module transformers has no attribute SwitchHeadForCausalLM" (HTTP 500). Here,
an architecture the `transformers` module does not have is loaded through `AutoModelForCausalLM`, which resolves
both our registered class and a checkpoint's `auto_map` (with `--trust-remote-code`). Drop this override when
Transformers resolves `auto_map` / registered classes itself.

Two request checks sit in front of Transformers' handlers (`RequestChecks`, an ASGI middleware on its app),
because upstream accepts both requests with HTTP 200: a negative `max_tokens` (upstream: an empty completion) and a
prompt that does not fit the model's context (upstream: generates past `max_position_embeddings`). Both get
HTTP 400 with a message; the server keeps serving. A request for another model than the served one gets
upstream's own HTTP 400.

The serving dependencies (fastapi, uvicorn, openai: `pip install switchhead[serve]`) are imported only when a
server is started, so `import switchhead` never needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import re

# `transformers serve` flags this entry point passes through (name -> default); see `transformers serve --help`.
SERVE_DEFAULTS = {
    "continuous_batching": True,  # exact for every SwitchHead variant (tests/test_continuous_batching.py)
    "attn_implementation": None,
    "device": "cpu",
    "dtype": "auto",
    "trust_remote_code": False,
    "log_level": "warning",
    "default_seed": None,
    "enable_cors": False,
    "cb_block_size": None,
    "cb_num_blocks": None,
    "cb_max_batch_tokens": None,
    "cb_max_memory_percent": None,
}

# CPU defaults for the paged cache (upstream's defaults size it from free accelerator memory): 64 blocks of 256
# tokens, at most 1024 tokens per forward pass.
CPU_CACHE_BLOCKS = 64
CPU_MAX_BATCH_TOKENS = 1024


def split_model_revision(model_id_and_revision: str) -> tuple[str, str | None]:
    """`"org/model@rev"` -> `("org/model", "rev")`; a path that exists, or an id without "@", has no revision.

    Transformers up to 5.23 always hands `ModelManager._load_model` an id with "@revision" appended; 5.24 hands
    it a local folder as given (an "@" inside an existing path is part of the path).
    """
    if os.path.exists(model_id_and_revision):
        return model_id_and_revision, None
    if "@" not in model_id_and_revision:
        return model_id_and_revision, None
    model_id, _, revision = model_id_and_revision.rpartition("@")  # the last "@": "/tmp/ckpt@1000@main"
    return model_id, revision or None


def _model_manager_class():
    """Transformers' ModelManager with the model-class lookup fixed (see the module docstring)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.cli.serving.model_manager import ModelManager

    class SwitchHeadModelManager(ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            model_id, revision = split_model_revision(model_id_and_revision)
            config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=self.trust_remote_code)
            architecture = (config.architectures or [""])[0]
            if gguf_file is not None or hasattr(transformers, architecture):  # upstream handles these
                return super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)
            # the one change: resolve a registered class or the checkpoint's auto_map through the Auto class
            return AutoModelForCausalLM.from_pretrained(
                model_id, revision=revision, attn_implementation=self.attn_implementation, dtype=self.dtype,
                device_map=self.device, trust_remote_code=self.trust_remote_code,
                quantization_config=self.get_quantization_config(),
            )

    return SwitchHeadModelManager


class RequestChecks:
    """ASGI middleware: answer requests that cannot be served with HTTP 400 before they reach Transformers.

    Checks `/v1/completions` and `/v1/chat/completions` bodies: `max_tokens` / `max_completion_tokens` must be a
    non-negative integer, and the prompt (tokenized as the handler will tokenize it) must fit the model's context.
    Everything else is passed through untouched.
    """

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, model_manager):
        self.app = app
        self.model_manager = model_manager

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        error = self._check(scope["path"], body)
        if error is not None:
            payload = json.dumps({"detail": error}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _check(self, path: str, raw: bytes) -> str | None:
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return None  # malformed JSON: FastAPI answers it (422)
        if not isinstance(body, dict):
            return None
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                return f"{field} must be a non-negative integer, got {value!r}"
        manager = self.model_manager
        if manager.force_model is None or body.get("model") not in (None, manager.force_model):
            return None  # upstream answers a model this server does not hold
        loaded = manager.loaded_models.get(manager.process_model_name(manager.force_model))
        if loaded is None or loaded.model is None:
            return None
        tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            length = len(tokenizer(prompt)["input_ids"])
        else:
            messages = body.get("messages")
            if not isinstance(messages, list) or getattr(tokenizer, "chat_template", None) is None:
                return None
            try:
                length = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
            except Exception:  # let the handler report a bad conversation its own way
                return None
        context = getattr(loaded.model.config, "max_position_embeddings", None)
        if context is not None and length >= context:
            return (f"the prompt has {length} tokens, but {body.get('model') or manager.force_model} reads at most "
                    f"{context} (max_position_embeddings) including the generated ones; shorten the prompt")
        return None


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, **serve_options):
    """Serve `checkpoint` (a local folder or a Hub id) on http://host:port with Transformers' serving app.

    Requests name the model by the same `checkpoint` string. `serve_options` are `transformers serve` options
    (see `SERVE_DEFAULTS`: continuous batching is on by default). Blocks until the server stops.
    """
    from transformers.cli import serve as upstream_serve
    from transformers.cli.serving import server as upstream_server

    unknown = set(serve_options) - set(SERVE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown serve options {sorted(unknown)}; choose from {sorted(SERVE_DEFAULTS)}")
    options = {**SERVE_DEFAULTS, **serve_options}
    if str(options["device"]).startswith("cpu") and options["cb_num_blocks"] is None \
            and options["cb_max_memory_percent"] is None:
        # Upstream sizes the paged cache as a share of free device memory, on CPU of the whole RAM (and zeroes it):
        # bound it instead. The cache's bytes per token come from the config (K and V of `num_attention_heads`
        # heads of `head_dim` per layer), which is SwitchHead's real cache size.
        options["cb_num_blocks"] = CPU_CACHE_BLOCKS
        if options["cb_max_batch_tokens"] is None:
            options["cb_max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
    manager_class = _model_manager_class()
    import transformers.cli.serving.model_manager as model_manager_module

    build_server = upstream_server.build_server

    def build_checked_server(model_manager, *args, **kwargs):
        app = build_server(model_manager, *args, **kwargs)
        app.add_middleware(RequestChecks, model_manager=model_manager)
        return app

    # `Serve.__init__` imports `ModelManager` and `build_server` from these modules when it runs, then runs the
    # server (uvicorn, in this thread, with its signal handling): hand it ours while it runs, restore them after.
    saved = model_manager_module.ModelManager, upstream_server.build_server
    model_manager_module.ModelManager, upstream_server.build_server = manager_class, build_checked_server
    try:
        upstream_serve.Serve(force_model=checkpoint, host=host, port=port, **options)
    finally:
        model_manager_module.ModelManager, upstream_server.build_server = saved


# ==================================================================================================== command line
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
    from .cli import fail

    checkpoint = args.checkpoint
    if os.path.exists(checkpoint):
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            fail(f"{checkpoint!r} has no config.json; pass a save_pretrained folder or a Hub model id")
    elif not HUB_ID.match(checkpoint):
        fail(f"checkpoint {checkpoint!r} is neither an existing folder nor a Hub id (owner/name)")
    if "@" in checkpoint:
        fail(f"checkpoint {checkpoint!r} contains '@', which the server reads as a revision; "
                         f"rename or move the folder")
    if not 0 < args.port < 65536:
        fail(f"--port must be in 1..65535, got {args.port}")
    for flag in ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    import socket

    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((args.host, args.port))
        except OSError as error:
            fail(f"cannot listen on {args.host}:{args.port} ({error.strerror}); pick another --port "
                             f"or --host")
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        fail("serving needs fastapi, uvicorn and openai: pip install 'switchhead[serve]'")
    options = {name: getattr(args, name) for name in SERVE_DEFAULTS}
    try:
        serve(checkpoint, host=args.host, port=args.port, **options)
    except (OSError, ValueError, ImportError) as error:  # the checkpoint could not be loaded, the port is taken, ...
        fail(f"cannot serve {checkpoint!r}: {str(error).splitlines()[0] if str(error) else error!r}")
    return 0
