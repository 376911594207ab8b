"""The ASGI middleware in front of Transformers' app (`RequestChecks`): generation requests checked
(`serving.requests`) and given their own id, cancelled when their client leaves; `/health` and `/v1/models` answered
here; other routes 404.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING

from .requests import RequestChecker, RequestRefused

if TYPE_CHECKING:
    from .supervision import ServerState

MAX_BODY_BYTES = 4 << 20  # a request body larger than this gets 413 before it is parsed
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASS_THROUGH = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")  # FastAPI's own documentation pages


async def _respond(send, status: int, message: str, extra: dict | None = None, headers=()) -> None:
    payload = {"detail": message, "error": {"message": message, "type": "invalid_request_error" if status < 500
                                             else "server_error", "code": status}} if extra is None else extra
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes | None:
    """The whole request body (None when the client disconnected first); RequestRefused(413) past MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestRefused(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


class RequestChecks:
    """ASGI middleware in front of Transformers' app: checks generation requests (`RequestChecker`, off the event
    loop), gives each its own request id, cancels it when its client disconnects, and answers `/health` and
    `/v1/models` itself; routes this server does not serve get 404."""

    def __init__(self, app, state: "ServerState"):
        self.app = app
        self.state = state
        self.checker = RequestChecker(state)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if method == "OPTIONS":  # CORS preflight (--enable-cors) is the app's to answer
            return await self.app(scope, receive, send)
        if path == "/health" and method in ("GET", "HEAD"):
            status, payload = self.state.health()
            return await _respond(send, status, "", extra=payload)
        if path == "/v1/models" and method in ("GET", "HEAD"):
            return await _respond(send, 200, "", extra={"object": "list", "data": [self.state.model_card()]})
        if path in GENERATION_PATHS and method == "POST":
            return await self._generation(scope, receive, send)
        if path in PASS_THROUGH and method == "GET":
            return await self.app(scope, receive, send)
        return await _respond(send, 404, f"{method} {path} is not served here: this server answers POST "
                                         f"{' and '.join(GENERATION_PATHS)}, GET /v1/models and GET /health")

    async def _generation(self, scope, receive, send):
        state = self.state
        unavailable = state.unavailable()
        if unavailable is not None:
            return await _respond(send, 503, unavailable, headers=[(b"retry-after", b"1")])
        try:
            raw = await _read_body(receive)
            if raw is None:
                return  # the client left before sending its request
            # parsing, checking and tokenizing can take a second for a large prompt: a worker thread does it
            body, info = await asyncio.to_thread(self.checker.check, scope["path"], raw)
        except RequestRefused as refused:
            return await _respond(send, refused.status, str(refused))
        request_id = uuid.uuid4().hex  # ours, unique: a client's x-request-id could collide with another's
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"x-request-id", b"content-length")]
        scope = {**scope, "headers": headers + [(b"x-request-id", request_id.encode()),
                                                (b"content-length", str(len(body)).encode())]}
        state.register(request_id, info)
        try:
            await self._run_app(scope, receive, send, body, request_id)
        finally:
            state.unregister(request_id)

    async def _run_app(self, scope, receive, send, body: bytes, request_id: str):
        """Run the app with the checked body; watch the client, and cancel the request if it goes first."""
        disconnected = asyncio.Event()
        delivered = False
        handed_over = False

        async def app_receive():
            nonlocal handed_over
            if not handed_over:
                handed_over = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def app_send(message):
            nonlocal delivered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                delivered = True
            await send(message)

        async def watch_client():
            while True:  # after the body, the server's receive() returns only on a disconnect or the response's end
                if (await receive())["type"] == "http.disconnect":
                    return

        app_task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        watch_task = asyncio.ensure_future(watch_client())
        try:
            await asyncio.wait({app_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if watch_task.done() and not app_task.done() and not delivered:
                disconnected.set()  # a streaming response sees the disconnect itself and closes its generator
                self.state.cancel(request_id, "the client disconnected")
                try:
                    await asyncio.wait_for(asyncio.shield(app_task), timeout=1.0)
                except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                    app_task.cancel()  # a non-streamed handler waits for a result that will not come
                    try:
                        await app_task
                    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is left to tell
                        pass
            else:
                await app_task
        finally:
            watch_task.cancel()
