"""Transformers' generation managers with cancellation and per-request failures added (`_serving_classes`,
built when a server starts: the serving dependencies are imported only then).
"""

from __future__ import annotations

import asyncio
import threading

from .requests import RequestInfo
from .supervision import _guard_generation_steps

def _serving_classes():
    """Transformers' generation managers and shared state with cancellation and per-request failures added."""
    import torch
    from fastapi import HTTPException
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.cli.serving.utils import (
        CBGenerateManager,
        CBWorkerDeadError,
        GenerateManager,
        GenerationState,
        _StreamError,
    )

    class ClientGone(StoppingCriteria):
        """Stops generate() at the next token once the request is cancelled."""

        def __init__(self, cancelled: threading.Event):
            self.cancelled = cancelled

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), self.cancelled.is_set(), dtype=torch.bool,
                              device=input_ids.device)

    def failed(error: Exception, owner):
        state = getattr(owner, "switchhead_state", None)
        if state is not None and state.stopping:
            return HTTPException(status_code=503, detail="the server is shutting down; this request was not finished")
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return HTTPException(status_code=500, detail=f"generation failed for this request ({type(error).__name__}"
                                                     f"{': ' + text if text else ''}); the server keeps serving")

    def cut_off(info: RequestInfo):
        """A generation stopped by a cancellation is not a finished completion: its client gets an error."""
        return HTTPException(status_code=503, detail=f"the generation was stopped before its end ({info.reason})")

    class SafeGenerateManager(GenerateManager):
        """One generate() per request (no continuous batching): the request's own sampling wish is applied (upstream
        kept the model's do_sample=False under a temperature > 0) and a cancelled request stops generating."""

        def __init__(self, owner):
            super().__init__()
            self.owner = owner

        def _info(self, gen_config, request_id) -> RequestInfo | None:
            state = getattr(self.owner, "switchhead_state", None)
            info = state.request(request_id) if state is not None else None
            if info is not None and info.sampling is True:
                gen_config.do_sample = True
            return info

        def generate_streaming(self, model, processor, inputs, gen_config, *args, **kwargs):
            request_id = kwargs.get("request_id", args[0] if args else None)
            info = self._info(gen_config, request_id)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, *args, **kwargs)
            if info is not None:
                loop = asyncio.get_running_loop()

                def cancel():  # an error event first (the stream would otherwise end as if complete), then stop
                    loop.call_soon_threadsafe(queue.put_nowait, _StreamError(
                        f"the generation was stopped before its end ({info.reason})"))
                    streamer.cancel()

                info.on_cancel = cancel
                if info.cancelled.is_set():
                    cancel()
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            info = self._info(gen_config, request_id)
            arguments = {**inputs, "generation_config": gen_config, "tokenizer": processor}
            if info is not None:
                arguments["stopping_criteria"] = StoppingCriteriaList([ClientGone(info.cancelled)])
            try:
                sequences = await self.async_submit(model.generate, **arguments)
            except Exception as error:  # noqa: BLE001 - this request's failure, reported to its client alone
                raise failed(error, self.owner) from None
            if info is not None and info.cancelled.is_set():
                raise cut_off(info)
            prompt_length = inputs["input_ids"].shape[-1]
            generated = sequences[0, prompt_length:]
            return processor.decode(generated, skip_special_tokens=True), prompt_length, generated

    class SafeCBGenerateManager(CBGenerateManager):
        """Continuous batching with the step guard (`_guard_generation_steps`) and per-request failures as HTTP
        500 with a message."""

        def init_cb(self, model, gen_config):
            super().init_cb(model, gen_config)
            if self._cb is not None:
                _guard_generation_steps(self._cb)

        owner = None  # the SafeGenerationState that made it

        async def generate_non_streaming(self, *args, **kwargs):
            try:
                return await super().generate_non_streaming(*args, **kwargs)
            except CBWorkerDeadError:
                raise  # upstream's 503
            except RuntimeError as error:
                status = getattr(self._cb, "background_thread_status", None)
                state = getattr(self.owner, "switchhead_state", None)
                # a dying worker stops itself, then fails every request, then records its error: upstream may look
                # before the record and call it this request's failure; the stop request already tells
                if status is not None and not (state is not None and state.stopping) and \
                        (status.fatal_error is not None or status.local_status >= status.HARD_STOP):
                    raise CBWorkerDeadError(f"the generation worker stopped during this request ({error}); it is "
                                            "being restarted, retry in a moment") from None
                raise failed(error, self.owner) from None

    class SafeGenerationState(GenerationState):
        """The shared generation state handing out the managers above (one pinned model: no switching)."""

        switchhead_state = None

        def get_manager(self, model_id, use_cb=False):
            if use_cb:
                if self._cb_manager is None:
                    self._cb_manager = SafeCBGenerateManager(cb_config=self._cb_config)
                    self._cb_manager.owner = self
                    self._cb_model_id = model_id
                return self._cb_manager
            if model_id not in self._generate_managers:
                self._generate_managers[model_id] = SafeGenerateManager(self)
            return self._generate_managers[model_id]

    return SafeGenerationState
