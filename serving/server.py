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
  does not honour. Every documented field (`FIELDS` below) is checked for type and range, the prompt is tokenized
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

The serving dependencies (fastapi, uvicorn, openai: `pip install switchhead[serve]`) are imported only when a
server is started, so importing this module never needs them. The command line (`switchhead serve`, its checks
of the arguments) is `switchhead.cli.serve`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid

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

MAX_BODY_BYTES = 4 << 20  # a request body larger than this gets 413 before it is parsed
MAX_JSON_DEPTH = 32  # deeper JSON gets 400 (upstream's parser recursed into a RecursionError: HTTP 500)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
PASS_THROUGH = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")  # FastAPI's own documentation pages
ROLES = ("system", "developer", "user", "assistant")
SHUTDOWN_GRACE = 2.0  # seconds the cancelled requests get to send their last bytes after SIGTERM
SHUTDOWN_DEADLINE = 6.0  # seconds after SIGTERM when the process exits whatever still runs
SUPERVISE_EVERY = 0.2  # seconds between the supervisor's looks at the batching worker

# OpenAI fields this server cannot honour: accepted only with the neutral value, else refused (upstream ignored
# them silently). name -> (test of an accepted value, what is accepted)
NEUTRAL_ONLY = {
    "n": (lambda v: v == 1 and not isinstance(v, bool), "1 (one choice per request)"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "1"),
    "echo": (lambda v: v is False, "false"),
    "logprobs": (lambda v: v is False, "false (log-probabilities are not returned)"),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool), "0"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "0"),
    "tools": (lambda v: v == [], "an empty list (this model has no tool-call format)"),
    "functions": (lambda v: v == [], "an empty list"),
    "tool_choice": (lambda v: v in ("none", "auto"), '"none"'),
    "function_call": (lambda v: v in ("none", "auto"), '"none"'),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "a boolean"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
    "modalities": (lambda v: v == ["text"], '["text"]'),
    "audio": (lambda v: False, "null"),
    "prediction": (lambda v: False, "null"),
    "reasoning_effort": (lambda v: False, "null"),
    "web_search_options": (lambda v: False, "null"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto"'),
    "store": (lambda v: v is False, "false"),
    "metadata": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                        for k, x in v.items()), "an object of strings"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "suffix": (lambda v: isinstance(v, str), "a string"),
    "stream_options": (lambda v: isinstance(v, dict) and set(v) <= {"include_usage"}
                       and all(isinstance(x, bool) for x in v.values()), '{"include_usage": true or false}'),
}
# keys of a request's `generation_config` (a JSON string, without continuous batching): name -> (type, low, high)
GENERATION_CONFIG_KEYS = {
    "do_sample": (bool, None, None), "temperature": (float, 0.0, 100.0), "top_p": (float, 0.0, 1.0),
    "top_k": (int, 0, 1 << 20), "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 0.0, 100.0),
    "max_new_tokens": (int, 1, 1 << 30), "no_repeat_ngram_size": (int, 0, 1 << 10),
}


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


# ==================================================================================================== request checks
class RequestRefused(Exception):
    """A request the server will not run: HTTP `status` with `message` (one sentence naming the field)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class RequestInfo:
    """What the checks learnt about one admitted request, kept while it runs (keyed by its request id)."""

    def __init__(self, sampling: bool | None, stream: bool):
        self.sampling = sampling  # True: the request asked for sampling; False: greedy; None: the model's default
        self.stream = stream
        self.cancelled = threading.Event()  # set when its client disconnected or the server stops
        self.reason = ""  # why it was cancelled
        self.on_cancel = None  # ends its stream with an error, for generate() streaming without continuous batching


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _walk(value, path: str = "body", depth: int = 0) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH and strings that are not valid Unicode (a lone surrogate such
    as "\\ud800" parses, then breaks the tokenizer: upstream answered HTTP 500)."""
    if depth > MAX_JSON_DEPTH:
        raise RequestRefused(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestRefused(f"{path} is not valid Unicode (it holds a lone surrogate such as \\ud800)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(key, f"a key of {path}", depth + 1)
            _walk(item, f"{path}.{key}" if path != "body" else key, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", depth + 1)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRefused(f"{name} must be an integer, got {_show(value)}")
    if value < low or (high is not None and value > high):
        raise RequestRefused(f"{name} must be {'>= ' + str(low) if high is None else f'in [{low}, {high}]'}, "
                             f"got {_show(value)}")
    return value


def _is_number(value) -> bool:
    """A JSON number that is not a bool, NaN or infinite. Integers are compared as integers: one of 400 digits
    parses, and `math.isfinite` (or `float`) of it overflows."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise RequestRefused(f"{name} must be a number, got {_show(value)}")
    if value < low or (low_open and value == low) or value > high:
        raise RequestRefused(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {_show(value)}")
    return float(value)


def _generation_config(body: dict) -> dict | None:
    """The request's `generation_config` (a JSON string of an object) with every key checked, or None."""
    raw = body.get("generation_config")
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise RequestRefused(f"generation_config must be a JSON string of an object, got {_show(raw)}")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise RequestRefused(f"generation_config is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise RequestRefused(f"generation_config must be a JSON object, got {_show(config)}")
    for key, value in config.items():
        if key not in GENERATION_CONFIG_KEYS:
            raise RequestRefused(f"generation_config.{key} is not accepted here; use "
                                 f"{', '.join(sorted(GENERATION_CONFIG_KEYS))}")
        kind, low, high = GENERATION_CONFIG_KEYS[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise RequestRefused(f"generation_config.{key} must be true or false, got {_show(value)}")
            continue
        if not _is_number(value) or (kind is int and not isinstance(value, int)):
            raise RequestRefused(f"generation_config.{key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {_show(value)}")
        if value < low or value > high or (key in ("top_p", "repetition_penalty") and value == 0):
            raise RequestRefused(f"generation_config.{key} must be in [{low}, {high}], got {_show(value)}")
    return config


class RequestChecker:
    """Checks one generation request body against the served model; thread-safe (it runs in worker threads)."""

    def __init__(self, state: "ServerState"):
        self.state = state

    def check(self, path: str, raw: bytes) -> tuple[bytes, RequestInfo]:
        """(the body to hand on, its RequestInfo), or RequestRefused."""
        state = self.state
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestRefused(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
        except ValueError as error:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
            raise RequestRefused(f"the body is not valid JSON ({str(error)[:120]})", status=422) from None
        if not isinstance(body, dict):
            raise RequestRefused(f"the body must be a JSON object, got {type(body).__name__}")
        _walk(body)
        chat = path == "/v1/chat/completions"
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or model != state.checkpoint):
            raise RequestRefused(f"this server serves {state.checkpoint!r} only; model {_show(model)} is not here")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise RequestRefused(f"stream must be true or false, got {_show(stream)}")
        for name, (accepted, description) in NEUTRAL_ONLY.items():
            if body.get(name) is not None and not accepted(body[name]):
                raise RequestRefused(f"{name} must be {description} on this server (it cannot honour "
                                     f"{_show(body[name])}); leave it out")
        max_new = _integer(body, "max_tokens", 1)
        if chat:
            completion_tokens = _integer(body, "max_completion_tokens", 1)
            max_new = completion_tokens if completion_tokens is not None else max_new
        temperature = _number(body, "temperature", 0.0, 2.0)
        top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
        penalty = _number(body, "frequency_penalty", 0.0, 2.0)  # upstream: repetition_penalty = 1 + it
        _integer(body, "seed", 0, (1 << 63) - 1)
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or \
                    not all(isinstance(item, str) and item for item in stops):
                raise RequestRefused(f"stop must be a non-empty string or a list of 1 to 4 of them, got {_show(stop)}")
        bias = body.get("logit_bias")
        if bias is not None and bias != {}:
            if not chat:
                raise RequestRefused("logit_bias is not honoured by /v1/completions here; leave it out")
            self._check_logit_bias(bias)
            # the same values as floats: upstream's logits processor takes an integer bias for a token id (HTTP 500)
            body["logit_bias"] = {key: float(value) for key, value in bias.items()}
        config = _generation_config(body)
        if temperature == 0 and top_p is not None and top_p < 1:
            raise RequestRefused("temperature 0 asks for greedy decoding, top_p < 1 for sampling: give one of them")
        if temperature == 0:
            sampling = False
        elif (temperature is not None and temperature > 0) or (top_p is not None and top_p < 1) \
                or (config or {}).get("do_sample") is True:
            sampling = True
        else:
            sampling = None
        if state.continuous_batching:
            self._check_batching_can_honour(temperature, top_p, penalty, stop, bias, config)

        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        if state.vocab_size is not None and max(ids) >= state.vocab_size:
            raise RequestRefused(f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary "
                                 f"(vocab_size {state.vocab_size}): this tokenizer does not fit the model")
        asked = max_new if max_new is not None else (config or {}).get("max_new_tokens")
        limit, what = state.token_limit()
        if limit is not None:
            if len(ids) >= limit:
                raise RequestRefused(f"the prompt has {len(ids)} tokens, but a sequence holds at most {limit} here "
                                     f"({what}) including the generated ones; shorten the prompt")
            if asked is None:
                body["max_tokens"] = limit - len(ids)  # OpenAI's default: up to the end of the context
            elif len(ids) + asked > limit:
                field = ("max_completion_tokens" if chat and body.get("max_completion_tokens") is not None
                         else "max_tokens" if max_new is not None else "generation_config.max_new_tokens")
                raise RequestRefused(f"{field} {asked} and the prompt's {len(ids)} tokens exceed the {limit} tokens a "
                                     f"sequence holds here ({what}); ask for at most {limit - len(ids)}")
        return json.dumps(body).encode(), RequestInfo(sampling, bool(stream))

    def _check_logit_bias(self, bias) -> None:
        if not isinstance(bias, dict):
            raise RequestRefused(f"logit_bias must be an object of token id -> bias, got {_show(bias)}")
        vocab = self.state.vocab_size
        for key, value in bias.items():
            if not (isinstance(key, str) and key.isdigit() and (vocab is None or int(key) < vocab)):
                raise RequestRefused(f"logit_bias key {key!r} is not a token id of this model's vocabulary")
            if not _is_number(value) or not -100 <= value <= 100:
                raise RequestRefused(f"logit_bias[{key}] must be a number in [-100, 100], got {_show(value)}")

    def _check_batching_can_honour(self, temperature, top_p, penalty, stop, bias, config) -> None:
        """Continuous batching decodes every request with the generation config it started with: refuse a request
        that asks for anything else (upstream decoded it with the shared settings and said nothing)."""
        shared = self.state.cb_generation_config
        hint = "; restart the server with --no-continuous-batching to set it per request"
        for name, value in (("generation_config", config), ("stop", stop), ("logit_bias", bias or None),
                            ("frequency_penalty", penalty or None)):
            if value is not None:
                raise RequestRefused(f"{name} is not applied per request under continuous batching{hint}")
        if not shared.do_sample:
            if temperature not in (None, 0.0) or top_p not in (None, 1.0):
                asked = f"temperature {temperature:g}" if temperature not in (None, 0.0) else f"top_p {top_p:g}"
                raise RequestRefused(f"{asked} asks for sampling, but this server decodes every request greedily "
                                     f"(continuous batching, the model's generation config): use temperature 0 or "
                                     f"leave it out{hint}")
        else:
            if temperature == 0.0:
                raise RequestRefused(f"this server samples every request with temperature {shared.temperature} "
                                     f"(continuous batching, the model's generation config){hint}")
            for name, value, own in (("temperature", temperature, shared.temperature), ("top_p", top_p, shared.top_p)):
                if value is not None and own is not None and not math.isclose(value, float(own)):
                    raise RequestRefused(f"{name} {value:g} differs from the {own} this server samples every request "
                                         f"with (continuous batching){hint}")

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise RequestRefused("prompt is missing: give the text to continue")
        if not isinstance(prompt, str):
            raise RequestRefused(f"prompt must be one string (this server takes one text prompt per request), got "
                                 f"{_show(prompt)}")
        if not prompt:
            raise RequestRefused("prompt is empty: give at least one token of text to continue")
        ids = self.state.tokenizer(prompt)["input_ids"]  # as the handler will tokenize it
        if not ids:
            raise RequestRefused(f"prompt {_show(prompt)} gives no tokens with this tokenizer")
        return list(ids)

    def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if messages is None:
            raise RequestRefused("messages is missing: give a non-empty list of {role, content} objects")
        if not isinstance(messages, list) or not messages:
            raise RequestRefused(f"messages must be a non-empty list of {{role, content}} objects, got {_show(messages)}")
        converted = []
        for index, message in enumerate(messages):
            where = f"messages[{index}]"
            if not isinstance(message, dict):
                raise RequestRefused(f"{where} must be an object with role and content, got {_show(message)}")
            extra = sorted(set(message) - {"role", "content", "name"})
            if extra:
                raise RequestRefused(f"{where}.{extra[0]} is not supported here (messages take role, content, name)")
            role = message.get("role")
            if role not in ROLES:
                raise RequestRefused(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}")
            if message.get("name") is not None and not isinstance(message["name"], str):
                raise RequestRefused(f"{where}.name must be a string, got {_show(message['name'])}")
            content = message.get("content")
            if isinstance(content, str):
                texts = [content]
            elif isinstance(content, list):
                texts = []
                for part_index, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                            and set(part) <= {"type", "text"}):
                        raise RequestRefused(f"{where}.content[{part_index}] must be {{\"type\": \"text\", \"text\": "
                                             f"...}} (this model reads text only), got {_show(part)}")
                    texts.append(part["text"])
            else:
                raise RequestRefused(f"{where}.content must be a string or a list of text parts, got "
                                     f"{_show(content)}")
            converted.append({"role": role, "content": " ".join(texts)})  # as upstream hands an LLM its messages
        tokenizer = self.state.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestRefused("this model's tokenizer has no chat template; use /v1/completions")
        extra_kwargs = body.get("chat_template_kwargs")
        if extra_kwargs is not None and not isinstance(extra_kwargs, dict):
            raise RequestRefused(f"chat_template_kwargs must be an object, got {_show(extra_kwargs)}")
        reserved = sorted(set(extra_kwargs or {}) & _chat_template_arguments(tokenizer))
        if reserved:  # return_tensors, tokenize, ... would change what apply_chat_template returns (HTTP 500)
            raise RequestRefused(f"chat_template_kwargs.{reserved[0]} is an argument of the tokenizer's "
                                 "apply_chat_template, not a variable of the chat template; leave it out")
        try:
            ids = tokenizer.apply_chat_template(converted, add_generation_prompt=True, tools=body.get("tools"),
                                                tokenize=True, return_dict=True,
                                                **{**self.state.chat_template_kwargs, **(extra_kwargs or {})})
        except Exception as error:  # noqa: BLE001 - a template raising on these messages (Jinja errors vary)
            text = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            raise RequestRefused(f"the chat template cannot render these messages ({type(error).__name__}"
                                 f"{': ' + text if text else ''})") from None
        ids = list(ids["input_ids"])
        if not ids:
            raise RequestRefused("the messages give no tokens with this chat template")
        return ids


def _chat_template_arguments(tokenizer) -> set[str]:
    """The named parameters of `tokenizer.apply_chat_template`, which a request's `chat_template_kwargs` may not set:
    they are the server's (return_tensors, tokenize, ...); the other keys become variables of the template."""
    import inspect

    return {name for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)}


# ==================================================================================================== ASGI middleware
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


# ==================================================================================================== server state
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


# ==================================================================================================== managers
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


# ==================================================================================================== the server
def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, **serve_options):
    """Serve `checkpoint` (a local folder or a Hub id) on http://host:port with Transformers' serving app.

    Requests name the model by the same `checkpoint` string. `serve_options` are `transformers serve` options
    (see `SERVE_DEFAULTS`: continuous batching is on by default). Blocks until the server stops: SIGTERM or
    SIGINT (when called from the main thread) stop it within `SHUTDOWN_DEADLINE` seconds.
    """
    import inspect

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
    if stuck:  # both are non-daemon threads: the interpreter would wait for them at exit
        _exit_now(0, f"switchhead serve: stopped (cut off: {', '.join(stuck)})")


def _exit_now(code: int, message: str) -> None:
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
