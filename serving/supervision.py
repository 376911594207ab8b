"""What the server's parts share, and the supervision of the continuous-batching worker (`ServerState`): the
requests in flight and their cancellation, `/health`, a dead worker restarted, a failing batch kept to its own
requests (`_guard_generation_steps`).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from .requests import RequestInfo, normalize_generation_config

logger = logging.getLogger("switchhead.serving")

SUPERVISE_EVERY = 0.2  # seconds between the supervisor's looks at the batching worker


def _guard_generation_steps(manager) -> None:
    """Make an exception in one continuous-batching forward fail that batch's requests instead of the worker.

    Upstream's generation loop turns any exception into a fatal error: every request fails and the worker thread
    ends (HTTP 503 for good). Its batch processor has `handle_batch_error`, which fails exactly the requests of the
    batch that was running and frees their cache blocks; the step here calls it and skips the batch update that
    would follow (there is no result to apply). Only in synchronous batching (CPU, and GPU without async batching);
    elsewhere the loop keeps upstream's behaviour and the supervisor restarts a dead worker."""
    if getattr(manager, "_switchhead_guarded", False) or not hasattr(manager, "_generation_step"):
        return
    step = manager._generation_step

    def guarded_step():
        try:
            step()
        except Exception as error:  # noqa: BLE001 - whatever the forward raised belongs to this batch
            processor = getattr(manager, "batch_processor", None)
            if processor is None or getattr(processor, "use_async_batching", False) \
                    or not hasattr(processor, "handle_batch_error"):
                raise
            logger.error("a batch failed (%s: %s); its requests get the error, the worker goes on",
                         type(error).__name__, error)
            processor.handle_batch_error(error)

            def skip_update():  # once: the loop calls update_batch right after a step
                del processor.update_batch

            processor.update_batch = skip_update

    manager._generation_step = guarded_step
    manager._switchhead_guarded = True


def _paged_cache_tokens(manager, timeout: float = 120.0) -> int | None:
    """Tokens the paged cache of a started batching manager holds (it is created in the worker thread)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processor = getattr(manager, "batch_processor", None)
        cache = getattr(processor, "cache", None)
        if cache is not None:
            tokens = getattr(cache, "max_tokens_read", None)
            if tokens is None and getattr(cache, "num_blocks", None) and getattr(cache, "block_size", None):
                tokens = cache.num_blocks * cache.block_size
            return int(tokens) if tokens else None
        fatal = manager.background_thread_status.fatal_error
        if fatal is not None:
            raise RuntimeError(f"the continuous-batching worker did not start ({type(fatal).__name__}: {fatal})")
        time.sleep(0.02)
    raise TimeoutError(f"the continuous-batching worker did not create its paged cache in {timeout:.0f} s")


class ServerState:
    """What the request checks, `/health`, the worker supervisor and the shutdown share (one per server).

    Built by `build_checked_server` once the model is loaded and before the server listens: it starts the
    continuous-batching worker with the model's generation config (fixed for every request from then on), so
    the first request does not get to choose it, and learns the paged cache's capacity."""

    def __init__(self, checkpoint: str, model_manager, generation_state, completion_handler, chat_handler=None):
        self.checkpoint = checkpoint
        self.model_manager = model_manager
        self.generation_state = generation_state
        self.model_key = model_manager.process_model_name(checkpoint)
        model, processor = model_manager.load_model_and_processor(self.model_key)
        normalize_generation_config(getattr(model, "generation_config", None))  # before any request or worker uses it
        self.model = model
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.chat_template_kwargs = dict(getattr(chat_handler, "chat_template_kwargs", None) or {})
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size = getattr(model.config, "vocab_size", None)
        modality = model_manager.get_model_modality(model, processor=processor)
        self.continuous_batching = bool(generation_state.use_continuous_batching(model, modality))
        self.cache_tokens: int | None = None
        self.cb_generation_config = None
        self.requests: dict[str, RequestInfo] = {}
        self.lock = threading.Lock()
        self.restarting: str | None = None
        self.restarts = 0
        self.last_worker_error: str | None = None
        self.stopping = False
        self.created = int(os.path.getmtime(checkpoint)) if os.path.exists(checkpoint) else int(time.time())
        generation_state.switchhead_state = self
        if self.continuous_batching:
            self.cb_generation_config = completion_handler._build_generation_config({}, model.generation_config,
                                                                                    use_cb=True)
            manager = generation_state.get_manager(self.model_key, use_cb=True)
            manager.init_cb(model, self.cb_generation_config)
            self.cache_tokens = _paged_cache_tokens(manager._cb)

    # ---------------------------------------------------------------- facts
    def token_limit(self) -> tuple[int | None, str]:
        """(the most tokens one sequence may reach, what sets it)."""
        limits = [(self.context, "max_position_embeddings"), (self.cache_tokens, "the paged cache's capacity")]
        limits = [(value, what) for value, what in limits if value]
        return min(limits) if limits else (None, "")

    def batching_manager(self):
        """The running ContinuousBatchingManager (None without continuous batching)."""
        owner = getattr(self.generation_state, "_cb_manager", None)
        return getattr(owner, "_cb", None)

    def model_card(self) -> dict:
        return {"id": self.checkpoint, "object": "model", "created": self.created, "owned_by": "switchhead"}

    # ---------------------------------------------------------------- requests
    def register(self, request_id: str, info: RequestInfo) -> None:
        with self.lock:
            self.requests[request_id] = info

    def unregister(self, request_id: str) -> None:
        with self.lock:
            self.requests.pop(request_id, None)

    def request(self, request_id: str) -> RequestInfo | None:
        return self.requests.get(request_id)

    def cancel(self, request_id: str, why: str) -> None:
        """Stop generating for a request: the batching scheduler drops it, generate() stops at its next token."""
        info = self.requests.get(request_id)
        if info is not None:
            info.reason = why
            info.cancelled.set()
            if info.on_cancel is not None:
                info.on_cancel()
        manager = self.batching_manager()
        if manager is not None:
            manager.cancel_request(request_id)
            router = getattr(manager, "output_router", None)
            if router is not None:  # no result will come for it: drop its handler
                with router._lock:
                    router.result_handlers.pop(request_id, None)
        logger.info("request %s cancelled: %s", request_id, why)

    # ---------------------------------------------------------------- health and the worker
    def worker_failure(self) -> str | None:
        """Why the batching worker is not serving (None when it is, or without continuous batching)."""
        manager = self.batching_manager() if self.continuous_batching else None
        if manager is None:
            return None
        fatal = manager.background_thread_status.fatal_error
        if fatal is not None:
            return f"{type(fatal).__name__}: {fatal}"
        if not manager.is_running():
            return "the generation thread ended"
        return None

    def unavailable(self) -> str | None:
        if self.stopping:
            return "the server is shutting down"
        failure = self.restarting or self.worker_failure()
        if failure is not None:
            return f"the generation worker is restarting after an error ({failure}); retry in a moment"
        return None

    def health(self) -> tuple[int, dict]:
        base = {"continuous_batching": self.continuous_batching, "restarts": self.restarts,
                "last_worker_error": self.last_worker_error, "requests_in_flight": len(self.requests)}
        if self.stopping:
            return 503, {"status": "stopping", **base}
        failure = self.restarting or self.worker_failure()
        if failure is not None:
            return 503, {"status": "restarting", "reason": failure, **base}
        manager = self.batching_manager()
        scheduler = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
        if scheduler is not None:
            base["generations_in_flight"] = len(scheduler.active_requests) + len(scheduler.waiting_requests)
        return 200, {"status": "ok", **base}

    def restart_worker(self, reason: str) -> None:
        """Replace a dead batching worker by a new one with the same model, generation config and cache size."""
        self.restarting = reason
        self.last_worker_error = reason
        logger.error("the continuous-batching worker stopped (%s); restarting it", reason)
        owner = self.generation_state._cb_manager
        old = owner._cb
        try:
            old.stop(block=True, timeout=10)  # joins the ended thread, frees its cache, restores the attention
        except Exception as error:  # noqa: BLE001 - a dead manager may fail to stop cleanly; replace it anyway
            logger.error("stopping the dead worker failed: %s", error)
        new = self.model.init_continuous_batching(generation_config=old.generation_config,
                                                  continuous_batching_config=owner._cb_config)
        _guard_generation_steps(new)
        new.start()
        self.cache_tokens = _paged_cache_tokens(new)
        owner._cb = new
        self.restarts += 1
        self.restarting = None
        logger.error("the continuous-batching worker was restarted (restart %d)", self.restarts)

    def supervise(self, stop: threading.Event) -> None:
        """The supervisor thread: restart the batching worker whenever it has died."""
        while not stop.wait(SUPERVISE_EVERY):
            if self.stopping:
                return
            reason = self.worker_failure()
            if reason is None:
                continue
            try:
                self.restart_worker(reason)
            except Exception as error:  # noqa: BLE001 - stay "restarting" and try again shortly
                self.restarting = f"{reason}; restarting failed: {type(error).__name__}: {error}"
                logger.error("restarting the worker failed: %s", error)
                stop.wait(1.0)

    def cancel_all(self, why: str) -> None:
        """Stop every generate() in flight (without continuous batching); the batching worker is stopped instead,
        which fails its requests with an error their clients receive (a cancelled one would get nothing)."""
        for request_id, info in list(self.requests.items()):
            info.reason = why
            info.cancelled.set()
            if info.on_cancel is not None:
                info.on_cancel()
        logger.info("%d requests cancelled: %s", len(self.requests), why)
