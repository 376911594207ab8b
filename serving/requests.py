"""The checks of a generation request before Transformers' app sees it (`RequestChecker`): every documented field
for type and range, the prompt tokenized and held to the context and the paged cache, the fields continuous
batching cannot honour refused; a refusal is a `RequestRefused` with its HTTP status and one sentence naming the
field. `serving.middleware.RequestChecks` runs them; see `serving.server` for why the server has them.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Protocol

MAX_JSON_DEPTH = 32  # deeper JSON gets 400 (upstream's parser recursed into a RecursionError: HTTP 500)
ROLES = ("system", "developer", "user", "assistant")

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

# The lowest sampling temperature: generate() divides the float32 logits by it, and below float32's range (1e-300,
# 5e-324) the divisor is 0 and the probabilities NaN (upstream answered HTTP 500). Temperature 0 is greedy decoding.
MIN_SAMPLING_TEMPERATURE = 1e-4
# seconds a chat template may take to render one request's messages: a template that loops (nested loops of
# range(100000), recursive macros) is stopped there and the request gets 422, the server stays responsive
CHAT_TEMPLATE_SECONDS = 5.0


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
        if key == "temperature" and 0 < value < MIN_SAMPLING_TEMPERATURE:
            raise RequestRefused(f"generation_config.temperature must be 0 (greedy) or at least "
                                 f"{MIN_SAMPLING_TEMPERATURE:g} (sampling), got {_show(value)}")
        if kind is float:  # Transformers' logits processors take floats only: repetition_penalty 100 was HTTP 500
            config[key] = float(value)
    if config.get("do_sample") is True and config.get("temperature") == 0 and body.get("temperature") is None:
        raise RequestRefused("generation_config asks for sampling (do_sample true) at temperature 0; give a "
                             "temperature > 0, or do_sample false for greedy decoding")
    body["generation_config"] = json.dumps(config)
    return config


# float fields of a GenerationConfig that Transformers' logits processors refuse as integers
FLOAT_GENERATION_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "epsilon_cutoff",
                           "eta_cutoff", "encoder_repetition_penalty", "length_penalty")


def normalize_generation_config(generation_config) -> None:
    """The model's own generation config (its generation_config.json), made servable in place: integer values of
    float fields become floats (`"repetition_penalty": 100` failed every request with HTTP 500, 100.0 worked); a
    config that samples at temperature 0 or at one below MIN_SAMPLING_TEMPERATURE is a ValueError naming the file,
    at start-up rather than on every request."""
    if generation_config is None:
        return
    for name in FLOAT_GENERATION_FIELDS:
        value = getattr(generation_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(generation_config, name, float(value))
    temperature = getattr(generation_config, "temperature", None)
    if getattr(generation_config, "do_sample", False) and temperature is not None \
            and not temperature >= MIN_SAMPLING_TEMPERATURE:
        raise ValueError(f"generation_config.json samples (do_sample true) at temperature {temperature!r}; set a "
                         f"temperature >= {MIN_SAMPLING_TEMPERATURE:g} or do_sample false")


class ServedModel(Protocol):
    """What the checks read of the server's state (`serving.supervision.ServerState` has it)."""

    checkpoint: str
    continuous_batching: bool
    vocab_size: int | None
    cb_generation_config: Any
    tokenizer: Any
    chat_template_kwargs: dict

    def token_limit(self) -> tuple[int | None, str]: ...


class RequestChecker:
    """Checks one generation request body against the served model; thread-safe (it runs in worker threads)."""

    def __init__(self, state: ServedModel):
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
        if temperature is not None and 0 < temperature < MIN_SAMPLING_TEMPERATURE:
            raise RequestRefused(f"temperature must be 0 (greedy) or at least {MIN_SAMPLING_TEMPERATURE:g} "
                                 f"(sampling), got {_show(body['temperature'])}")
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
            ids = run_with_deadline(
                lambda: tokenizer.apply_chat_template(converted, add_generation_prompt=True, tools=body.get("tools"),
                                                      tokenize=True, return_dict=True,
                                                      **{**self.state.chat_template_kwargs, **(extra_kwargs or {})}),
                CHAT_TEMPLATE_SECONDS, "switchhead-chat-template")
        except DeadlinePassed:
            raise RequestRefused(f"the chat template did not finish rendering these messages within "
                                 f"{CHAT_TEMPLATE_SECONDS:g} s (it loops); fix the model's chat template",
                                 status=422) from None
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


class DeadlinePassed(Exception):
    """Raised inside a `run_with_deadline` call that ran past its time, and by `run_with_deadline` itself."""


def run_with_deadline(function, seconds: float, name: str):
    """`function()` in a daemon thread, its result or exception; DeadlinePassed when it has not returned within
    `seconds`. The late call is then interrupted at its next Python instruction (an asynchronous DeadlinePassed
    raised in its thread: a Jinja render is Python code), and if it is stuck in native code it is abandoned: as a
    daemon thread it never keeps the process alive, so SIGTERM still stops the server."""
    import ctypes

    box: dict[str, Any] = {}
    lock = threading.Lock()

    def target():
        try:
            value = function()
            with lock:
                box["value"] = value
        except BaseException as error:  # noqa: BLE001 - handed to the caller (DeadlinePassed: nobody waits)
            with lock:
                box.setdefault("error", error)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    with lock:
        finished = "value" in box or "error" in box
        if not finished:
            box["error"] = DeadlinePassed()  # what the caller sees, whatever the thread does from now on
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(DeadlinePassed))
    if not finished:
        raise DeadlinePassed(f"{name} ran past {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
