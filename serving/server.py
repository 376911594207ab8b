"""Serve a SwitchHead checkpoint with Transformers' own OpenAI-compatible server (`transformers serve`).

    switchhead serve CHECKPOINT [--host 127.0.0.1] [--port 8000]      # command line
    from switchhead.serving import serve; serve("path/or/hub-id", port=8000)   # Python

Everything that answers a generation request -- the FastAPI app, `/v1/completions`, `/v1/chat/completions`
(streamed or not), the continuous-batching manager with its paged KV cache, `generate()` without it -- is
Transformers' (`transformers.cli.serve.Serve`). What is ours, and why:

- **The model class** (`SwitchHeadModelManager._load_model`). Transformers 5.23 looks the class up as
  `getattr(transformers, config.architectures[0])`, so a registered or remote-code architecture fails with "module
  transformers has no attribute SwitchHeadForCausalLM"; ours loads such a model through `AutoModelForCausalLM`.
- **Request checks** (`RequestChecks`, an ASGI middleware in front of the app). Upstream lets requests reach the
  batching worker that kill it ("prompt": "" ends it with "input_ids is empty"; `max_tokens` 10^9 outgrows the
  paged cache: "No requests can be scheduled"), answers wrong types with HTTP 500 and silently ignores values it
  does not honour. Every documented field (`serving/requests.py`) is checked for type and range, the prompt is tokenized
  (in a worker thread, off the event loop) and must fit the context and the paged cache together with `max_tokens`
  (filled in as the room left when it is not given); what fails gets HTTP 400 (413 for a body over 4 MiB) with
  one sentence naming the field. Continuous batching runs every request with one generation configuration (the
  model's, fixed at start-up), so a request that asks for other sampling settings, `stop` or a penalty is refused
  there instead of being silently decoded otherwise; `--no-continuous-batching` honours them per request.
- **Failures stay with their request.** An exception in a continuous-batching forward fails the requests of that
  batch (Transformers' own `handle_batch_error`) and the loop goes on; a worker that dies anyway is restarted by a
  supervisor thread while `/health` answers 503 "restarting". Without continuous batching each request is its own
  `generate()` call and its failure is its own HTTP 500.
- **Cancellation.** A client that disconnects, streamed or not, has its generation cancelled: the batching
  scheduler drops it, or `generate()` stops at the next token (a stopping criterion).
- **Shutdown.** SIGTERM / SIGINT cancel what is in flight and stop the server within `SHUTDOWN_DEADLINE` seconds in
  both modes (uvicorn alone waits for every open request to finish).
- **Endpoints.** `/v1/models` lists the served checkpoint (upstream scans the Hugging Face cache folder and fails
  without one); `/health` says "ok", "restarting" or "stopping" with counts; the other upstream routes
  (`/v1/responses`, `/load_model`, `/reset`, ...) are not served: `/reset` would unload the pinned model.

The parts live in rooms of one purpose: `requests.py` (the checks), `middleware.py` (the ASGI middleware that runs
them, `/health`, `/v1/models`), `supervision.py` (the shared state and the worker's supervision), `managers.py`
(Transformers' generation managers with cancellation and per-request failures); this file builds the server and
runs it to its end. The serving dependencies (fastapi, uvicorn, openai: `pip install switchhead[serve]`) are
imported only when a server is started, so importing this package never needs them. The command line (`switchhead serve`, its checks
of the arguments) is `switchhead.cli.serve`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from .managers import _serving_classes
from .middleware import RequestChecks
from .supervision import ServerState

logger = logging.getLogger("switchhead.serving")

# `transformers serve` flags this entry point passes through (name -> default); see `transformers serve --help`.
SERVE_DEFAULTS = {
    "continuous_batching": True,  # exact for every SwitchHead variant (tests/serving/test_continuous_batching.py)
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
DEFAULT_CB_BLOCK_SIZE = 256  # Transformers' paged-cache block (page) size, when --cb-block-size is not given
SHUTDOWN_GRACE = 2.0  # seconds the cancelled requests get to send their last bytes after SIGTERM
SHUTDOWN_DEADLINE = 6.0  # seconds after SIGTERM when the process exits whatever still runs


def split_model_revision(model_id_and_revision: str) -> tuple[str, str | None]:
    """`"org/model@rev"` -> `("org/model", "rev")`; a path that exists, or an id without "@", has no revision.

    Transformers up to 5.23 always hands `ModelManager._load_model` an id with "@revision" appended; 5.24 hands
    it a local folder as given (an "@" inside an existing path is part of the path).
    """
    if os.path.exists(model_id_and_revision):
        return model_id_and_revision, None
    if "@" not in model_id_and_revision:
        return model_id_and_revision, None
    model_id, _, revision = model_id_and_revision.rpartition("@")  # the last "@": "runs/ckpt@1000@main"
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


# What this file and managers.py subclass or replace in Transformers' server, module -> names. Transformers 5.25
# rebuilt its server around other classes (GenerateRunner, ...): there these are missing and serving refuses.
UPSTREAM_NAMES = {
    "transformers.cli.serve": ("Serve",),
    "transformers.cli.serving.server": ("build_server",),
    "transformers.cli.serving.model_manager": ("ModelManager",),
    "transformers.cli.serving.utils": ("CBGenerateManager", "CBWorkerDeadError", "GenerateManager",
                                       "GenerationState", "_StreamError"),
}


def upstream_server_gap() -> list[str]:
    """The names of `UPSTREAM_NAMES` that the installed Transformers lacks ("module.name"); empty where `serve`
    can wrap its server. A serving dependency that is missing (fastapi, ...) raises its ImportError instead."""
    import importlib

    missing = []
    for module_name, names in UPSTREAM_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("transformers"):
                raise
            missing.extend(f"{module_name}.{name}" for name in names)
            continue
        missing.extend(f"{module_name}.{name}" for name in names if not hasattr(module, name))
    return missing


def check_upstream_server() -> None:
    """Raise an ImportError naming the releases to install where Transformers' server is not the one `serve`
    wraps (Transformers 5.25 on)."""
    missing = upstream_server_gap()
    if missing:
        import transformers

        from switchhead import transformers_compat as compat

        raise ImportError(
            f"switchhead serve wraps the server of transformers {compat.OLDEST_SUPPORTED} to {compat.NEWEST_TESTED}, "
            f"and transformers {transformers.__version__} has another one (no {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); run "
            f"pip install 'transformers{compat.SUPPORTED_RANGE}'")


# ==================================================================================================== the server
def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, **serve_options):
    """Serve `checkpoint` (a local folder or a Hub id) on http://host:port with Transformers' serving app.

    Requests name the model by the same `checkpoint` string. `serve_options` are `transformers serve` options
    (see `SERVE_DEFAULTS`: continuous batching is on by default). Blocks until the server stops: SIGTERM or
    SIGINT (when called from the main thread) stop it within `SHUTDOWN_DEADLINE` seconds.
    """
    import inspect

    check_upstream_server()
    import transformers.cli.serving.model_manager as model_manager_module
    from transformers.cli import serve as upstream_serve
    from transformers.cli.serving import server as upstream_server
    from transformers.cli.serving import utils as upstream_utils

    unknown = set(serve_options) - set(SERVE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown serve options {sorted(unknown)}; choose from {sorted(SERVE_DEFAULTS)}")
    options = {**SERVE_DEFAULTS, **serve_options}
    if str(options["log_level"]).lower() not in ("info", "debug"):  # its "Loading CHECKPOINT@main" is no warning
        logging.getLogger("transformers.cli.serving.model_manager").addFilter(_LOADING_NOTICE)
    if str(options["device"]).startswith("cpu") and options["cb_num_blocks"] is None \
            and options["cb_max_memory_percent"] is None:
        # Upstream sizes the paged cache as a share of free device memory, on CPU of the whole RAM (and zeroes it):
        # bound it instead. The cache's bytes per token come from the config (K and V of `num_attention_heads`
        # heads of `head_dim` per layer), which is SwitchHead's real cache size.
        options["cb_num_blocks"] = CPU_CACHE_BLOCKS
        if options["cb_max_batch_tokens"] is None:
            options["cb_max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
    build_server = upstream_server.build_server
    built: dict[str, ServerState] = {}

    def build_checked_server(model_manager, chat_handler, *args, **kwargs):
        app = build_server(model_manager, chat_handler, *args, **kwargs)
        state = ServerState(checkpoint, model_manager, kwargs["generation_state"], kwargs["completion_handler"],
                            chat_handler)
        app.add_middleware(RequestChecks, state=state)
        built["state"] = state
        return app

    # `Serve.__init__` imports `ModelManager`, `GenerationState` and `build_server` from these modules when it runs:
    # hand it ours while it builds the server, restore them after.
    saved = model_manager_module.ModelManager, upstream_server.build_server, upstream_utils.GenerationState
    model_manager_module.ModelManager = _model_manager_class()
    upstream_server.build_server = build_checked_server
    upstream_utils.GenerationState = _serving_classes()
    non_blocking = "non_blocking" in inspect.signature(upstream_serve.Serve.__init__).parameters
    try:
        instance = upstream_serve.Serve(force_model=checkpoint, host=host, port=port,
                                        **({"non_blocking": True} if non_blocking else {}), **options)
    finally:
        model_manager_module.ModelManager, upstream_server.build_server, upstream_utils.GenerationState = saved
    if non_blocking:  # (a release without non_blocking ran uvicorn, with its own signal handling, to the end above)
        _run_until_stopped(instance, built["state"], host, port)


class _LoadingNotice(logging.Filter):
    """Drops Transformers' server's "Loading MODEL" line, which it logs as a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Loading ")


_LOADING_NOTICE = _LoadingNotice()


def _run_until_stopped(instance, state: ServerState, host: str, port: int) -> None:
    """Supervise the batching worker until SIGTERM / SIGINT (or uvicorn's end), then stop within the deadline."""
    stop = threading.Event()
    supervisor = threading.Thread(target=state.supervise, args=(stop,), name="switchhead-supervisor", daemon=True)
    supervisor.start()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(number, frame):
            if stop.is_set():  # a second signal: no more waiting
                _exit_now(1, "switchhead serve: stopped at once (second signal)")
            stop.set()

        for number in (signal.SIGTERM, signal.SIGINT):
            previous[number] = signal.signal(number, on_signal)
    server, thread = instance.server, instance._thread
    try:
        while not stop.is_set() and thread.is_alive():
            stop.wait(0.25)
        if not thread.is_alive() and not getattr(server, "started", True):
            raise OSError(f"cannot listen on {host}:{port}")
        _shutdown(instance, state, stop)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _shutdown(instance, state: ServerState, stop: threading.Event) -> None:
    """Cancel every request in flight, let uvicorn close its connections, stop the batching worker; whatever still
    runs after SHUTDOWN_DEADLINE seconds (a forward pass that does not end) is cut by exiting the process."""
    deadline = time.monotonic() + SHUTDOWN_DEADLINE
    stop.set()
    state.stopping = True
    state.cancel_all("the server is stopping")
    manager = state.batching_manager()
    if manager is not None:  # fail what is queued or decoding now; the thread ends after its current step
        try:
            status = manager.background_thread_status
            status.request_stop(status.HARD_STOP, manager.distributed_helper.global_rank)
            manager._wake_up_loop.set()
        except Exception as error:  # noqa: BLE001 - an older release's internals: the stop below still runs
            logger.info("could not hard-stop the batching worker early: %s", error)
    server, thread = instance.server, instance._thread
    server.should_exit = True
    thread.join(timeout=SHUTDOWN_GRACE)
    if thread.is_alive():
        server.force_exit = True  # stop waiting for open connections
        thread.join(timeout=max(0.1, deadline - time.monotonic() - 1.0))
    worker = getattr(manager, "_generation_thread", None)
    stopper = threading.Thread(target=instance._generation_state.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=max(0.1, deadline - time.monotonic()))
    stuck = [t.name for t in (thread, worker) if t is not None and t.is_alive()]
    # any other non-daemon thread still running (a request's check in the event loop's executor) would keep the
    # interpreter waiting at exit as well
    stuck += [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t not in (thread, worker)
              and t is not threading.current_thread() and t is not threading.main_thread()]
    if stuck:  # non-daemon threads: the interpreter would wait for them at exit
        _exit_now(0, f"switchhead serve: stopped (cut off: {', '.join(stuck)})")
    if any(t.is_alive() for t in threading.enumerate() if t.daemon):
        # a daemon thread (a request's generation, the supervisor) that still writes to stderr while the
        # interpreter shuts down aborts the process ("could not acquire lock for <stderr>", SIGABRT): leave without
        # the interpreter's shutdown, everything written so far flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _exit_now(code: int, message: str) -> None:
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
