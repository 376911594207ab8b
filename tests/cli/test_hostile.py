"""Hostile input: what a careless user or an attacker sends must fail alone, loudly and safely.

Server cases run against a real `switchhead serve` subprocess on loopback (a free port, always stopped): one
server with continuous batching shared by the module, one without it. After every hostile request a normal greedy
request must return exactly what `generate()` gives in this process. The server process is started through a small
launcher that can inject faults on request (a file in a folder of the test's): a forward pass that raises, a
forward pass that is slow, a batching worker that dies, a restart that is slow. Nothing is injected unless the
test creates the file.

Training cases run the tiny preset for a few steps on WikiText-2's validation text: a code-running pickle
planted in every file a resume reads (with and without a manifest) runs nothing; a second writer of a run folder
is refused naming the first; an RNG state that does not load stops the resume unless --inexact-resume; a full
disk during a save, binary data and a damaged tokenizer end with one line and exit code 2.
"""

from __future__ import annotations

import csv
import http.client
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.runs import corpus  # noqa: F401 - the module-scoped fixture: data, tokenizer
from helpers.hub_folder import save_hub_folder
from helpers.server import Server, expected_text, free_port, make_checkpoint

from switchhead.cli import main
from switchhead.integrity import LOCK_NAME, MANIFEST
from switchhead.training import checkpoint_dirs

NORMAL_PROMPT = "The quick brown fox jumps over"
NORMAL_TOKENS = 8

# The server subprocess: fault injection through files in SWITCHHEAD_TEST_FAULTS, then the real CLI.
LAUNCHER = r"""
import os, sys, time
faults = os.environ["SWITCHHEAD_TEST_FAULTS"]

def take(name):
    path = os.path.join(faults, name)
    if not os.path.exists(path):
        return None
    text = open(path).read()
    if name in ("raise", "kill-worker"):
        os.remove(path)  # one fault per file
    return text

import switchhead
from switchhead import SwitchHeadForCausalLM
from transformers.generation.continuous_batching import continuous_api

forward = SwitchHeadForCausalLM.forward
def faulty_forward(self, *args, **kwargs):
    if take("raise") is not None:
        raise RuntimeError("injected fault in a forward pass")
    delay = take("slow")
    if delay:
        time.sleep(float(delay))
    return forward(self, *args, **kwargs)
SwitchHeadForCausalLM.forward = faulty_forward

prepare = continuous_api.ContinuousBatchProcessor.prepare_next_batch
def faulty_prepare(self):
    if take("kill-worker") is not None:
        raise RuntimeError("injected death of the batching worker")
    return prepare(self)
continuous_api.ContinuousBatchProcessor.prepare_next_batch = faulty_prepare

start = continuous_api.ContinuousBatchingManager.start
def slow_start(self):
    delay = take("slow-start")
    if delay:
        time.sleep(float(delay))
    return start(self)
continuous_api.ContinuousBatchingManager.start = slow_start

from switchhead.cli import main
sys.exit(main())
"""


class HostileServer(Server):
    """`switchhead serve CHECKPOINT` through the fault-injecting launcher; `stop()` always ends it."""

    LAUNCHER = LAUNCHER

    def __init__(self, checkpoint: Path, faults: Path, *flags: str):
        faults.mkdir(exist_ok=True)
        self.faults = faults
        home = faults / "empty-hf-home"  # no Hugging Face cache folder at all: /v1/models must still work
        super().__init__(str(checkpoint), *flags, log_dir=str(faults), env={
            "SWITCHHEAD_TEST_FAULTS": str(faults), "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub")})
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def fault(self, name: str, content: str = "") -> None:
        (self.faults / name).write_text(content)

    def clear(self, name: str) -> None:
        (self.faults / name).unlink(missing_ok=True)

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 60):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode(errors="replace")

    def get(self, path: str):
        return self.request("GET", path, timeout=5)

    def post(self, path: str, body) -> tuple[int, object]:
        return self.request("POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())

    def complete(self, prompt: str = NORMAL_PROMPT, **fields) -> str:
        status, answer = self.post("/v1/completions", {"model": self.checkpoint, "prompt": prompt,
                                                        "max_tokens": NORMAL_TOKENS, "temperature": 0, **fields})
        assert status == 200, answer
        return answer["choices"][0]["text"]


def open_stream(server: HostileServer, body: dict) -> socket.socket:
    """Send a request on a raw socket and return it unread: the test decides when the client goes away."""
    payload = json.dumps(body).encode()
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return connection


def sigterm(server: HostileServer, what: str, bound: float = 8.0) -> None:
    """SIGTERM the server: it must exit 0 within `bound` seconds (the measured time is printed, see docs/reliability.md)."""
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=15) == 0
    elapsed = time.monotonic() - started
    print(f"{what}, stopped after {elapsed:.1f} s")
    assert elapsed < bound, elapsed


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {what} (last: {value!r})")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, reference greedy text) for a tiny SwitchAll with continuous batching (the default)."""
    root = tmp_path_factory.mktemp("hostile-serve")
    model, tokenizer = make_checkpoint(root / "tiny-switchall", "tiny-switchall")
    reference = expected_text(model, tokenizer, tokenizer(NORMAL_PROMPT)["input_ids"], NORMAL_TOKENS)
    server = HostileServer(root / "tiny-switchall", root / "faults")
    try:
        assert server.complete() == reference
        yield server, reference, model, tokenizer
    finally:
        server.stop()


# ================================================================================================ server: requests
CONTEXT = 128  # the tiny presets' max_position_embeddings
HUGE = 10**400  # a JSON integer Python parses (up to 4300 digits) and no float holds
COMPLETION_CASES = [
    # (what, body fields over {"prompt": NORMAL_PROMPT}, status, words of the message)
    ("empty prompt", {"prompt": ""}, 400, "prompt is empty"),
    ("no prompt", {"prompt": None}, 400, "prompt is missing"),
    ("prompt list", {"prompt": ["a", "b"]}, 400, "prompt must be one string"),
    ("prompt number", {"prompt": 5}, 400, "prompt must be one string"),
    ("lone surrogate", {"prompt": "ab\ud800cd"}, 400, "not valid Unicode"),
    ("prompt over the context", {"prompt": "word " * (CONTEXT + 20)}, 400, "max_position_embeddings"),
    ("max_tokens 10^9", {"max_tokens": 10**9}, 400, "ask for at most"),
    ("max_tokens past the context", {"max_tokens": 200}, 400, "ask for at most"),
    ("max_tokens 0", {"max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ("max_tokens -1", {"max_tokens": -1}, 400, "max_tokens must be >= 1"),
    ("max_tokens string", {"max_tokens": "5"}, 400, "max_tokens must be an integer"),
    ("max_tokens bool", {"max_tokens": True}, 400, "max_tokens must be an integer"),
    ("max_tokens float", {"max_tokens": 1.5}, 400, "max_tokens must be an integer"),
    ("temperature -1", {"temperature": -1}, 400, "temperature must be in [0, 2]"),
    ("temperature 3", {"temperature": 3}, 400, "temperature must be in [0, 2]"),
    ("temperature string", {"temperature": "hot"}, 400, "temperature must be a number"),
    ("temperature sampling under batching", {"temperature": 0.7}, 400, "decodes every request greedily"),
    ("top_p 2", {"top_p": 2}, 400, "top_p must be in (0, 1]"),
    ("top_p 0", {"top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("top_p with temperature 0", {"top_p": 0.5}, 400, "give one of them"),
    ("n 1000", {"n": 1000}, 400, "n must be 1"),
    ("best_of 3", {"best_of": 3}, 400, "best_of must be 1"),
    ("echo", {"echo": True}, 400, "echo must be false"),
    ("logprobs", {"logprobs": 5}, 400, "logprobs must be false"),
    ("presence_penalty", {"presence_penalty": 1}, 400, "presence_penalty must be 0"),
    ("negative frequency_penalty", {"frequency_penalty": -1}, 400, "frequency_penalty must be in [0, 2]"),
    ("frequency_penalty string", {"frequency_penalty": "x"}, 400, "frequency_penalty must be a number"),
    ("frequency_penalty under batching", {"frequency_penalty": 0.5}, 400, "not applied per request"),
    ("seed string", {"seed": "x"}, 400, "seed must be an integer"),
    ("seed negative", {"seed": -1}, 400, "seed must be in"),
    ("stop five", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be"),
    ("stop number", {"stop": 5}, 400, "stop must be"),
    ("stop under batching", {"stop": "."}, 400, "stop is not applied per request"),
    ("generation_config not JSON", {"generation_config": "{nope"}, 400, "generation_config is not valid JSON"),
    ("generation_config number", {"generation_config": 5}, 400, "generation_config must be a JSON string"),
    ("generation_config beams", {"generation_config": '{"num_beams": 1000}'}, 400, "num_beams is not accepted"),
    ("stream string", {"stream": "yes"}, 400, "stream must be true or false"),
    ("suffix number", {"suffix": 5}, 400, "suffix must be a string"),
    ("model number", {"model": 5}, 400, "serves"),
    ("another model", {"model": "gpt-4"}, 400, "serves"),
    ("logit_bias on completions", {"logit_bias": {"1": 5}}, 400, "logit_bias is not honoured"),
    # integers of 401 digits: `math.isfinite` of one overflows (HTTP 500 before round three)
    ("temperature of 401 digits", {"temperature": HUGE}, 400, "temperature must be in [0, 2]"),
    ("top_p of 401 digits", {"top_p": HUGE}, 400, "top_p must be in (0, 1]"),
    ("frequency_penalty of 401 digits", {"frequency_penalty": HUGE}, 400, "frequency_penalty must be in [0, 2]"),
    ("generation_config max_new_tokens of 401 digits", {"generation_config": json.dumps({"max_new_tokens": HUGE})},
     400, "generation_config.max_new_tokens must be in"),
    ("generation_config top_k of 401 digits", {"generation_config": json.dumps({"top_k": HUGE})}, 400,
     "generation_config.top_k must be in"),
]
CHAT_CASES = [
    ("no messages", {}, 400, "messages is missing"),
    ("empty messages", {"messages": []}, 400, "messages must be a non-empty list"),
    ("messages string", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("message number", {"messages": [5]}, 400, "messages[0] must be an object"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role must be"),
    ("integer content", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "reads text only"),
    ("tool call message", {"messages": [{"role": "assistant", "content": "", "tool_calls": []}]}, 400,
     "tool_calls is not supported"),
    ("tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools must be an empty list"),
    ("max_completion_tokens 10^9", {"messages": [{"role": "user", "content": "hi"}],
                                    "max_completion_tokens": 10**9}, 400, "max_completion_tokens 1000000000"),
    ("logprobs", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs must be false"),
    ("json format", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     400, "response_format must be"),
    ("logit_bias outside the vocabulary", {"messages": [{"role": "user", "content": "hi"}],
                                           "logit_bias": {"99999999": 1}}, 400, "not a token id"),
    ("chat over the context", {"messages": [{"role": "user", "content": "word " * CONTEXT}]}, 400,
     "max_position_embeddings"),
    ("chat_template_kwargs return_tensors", {"messages": [{"role": "user", "content": "hi"}],
                                             "chat_template_kwargs": {"return_tensors": "pt"}}, 400,
     "chat_template_kwargs.return_tensors is an argument"),
    ("chat_template_kwargs tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                       "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs.tokenize is an argument"),
]
RAW_CASES = [
    ("malformed JSON", b"{not json", 422, "not valid JSON"),
    ("a list, not an object", b"[1, 2, 3]", 400, "must be a JSON object"),
    ("nested 100000 deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested deeper"),
    ("nested 40 deep", b'{"prompt": "a", "metadata": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, 400, "nested deeper"),
    ("an integer of 5000 digits", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 422, "not valid JSON"),
    ("NaN temperature", b'{"prompt": "a", "temperature": NaN}', 400, "temperature must be a number"),
    ("a 5 MiB body", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, "larger than"),
]


def assert_refused(server: HostileServer, path: str, body, status: int, words: str) -> None:
    got, answer = server.post(path, body)
    message = answer.get("detail") if isinstance(answer, dict) else answer
    assert got == status and words in str(message), (path, got, answer)


def test_every_hostile_request_gets_4xx_naming_the_field_and_the_server_stays_exact(served):
    server, reference, _, _ = served
    cases = ([("/v1/completions", {"model": server.checkpoint, "prompt": NORMAL_PROMPT, "temperature": 0, **fields},
               status, words, what) for what, fields, status, words in COMPLETION_CASES]
             + [("/v1/chat/completions", {"model": server.checkpoint, "temperature": 0, "max_tokens": 4, **fields},
                 status, words, what) for what, fields, status, words in CHAT_CASES]
             + [("/v1/completions", raw, status, words, what) for what, raw, status, words in RAW_CASES])
    for path, body, status, words, what in cases:
        if isinstance(body, dict) and body.get("prompt", "x") is None:
            del body["prompt"]
        assert_refused(server, path, body, status, words)
        assert server.get("/health")[0] == 200, what
        assert server.complete() == reference, what  # the same greedy output after every hostile request
    assert "[transformers] Loading" not in server.output()  # upstream logs loading the model as a warning


def test_unserved_routes_get_404_and_models_works_without_a_hub_cache(served):
    server, reference, _, _ = served
    for method, path in (("POST", "/reset"), ("POST", "/load_model"), ("POST", "/v1/responses"),
                         ("POST", "/v1/systemone"), ("GET", "/v1/completions"), ("POST", "/v1/models")):
        status, answer = server.request(method, path, b"{}" if method == "POST" else None)
        assert status == 404 and "not served here" in answer["detail"], (method, path, status, answer)
    status, models = server.get("/v1/models")  # the server runs with HF_HOME pointing at a folder that is not there
    assert status == 200 and [m["id"] for m in models["data"]] == [server.checkpoint]
    assert server.complete() == reference  # /reset did not unload the model


def test_no_max_tokens_means_up_to_the_end_of_the_context(served):
    server, _, model, tokenizer = served
    text = NORMAL_PROMPT + " and" * 100  # leaves room for a few tokens only
    status, answer = server.post("/v1/completions", {"prompt": text, "temperature": 0})
    prompt = tokenizer(text)["input_ids"]
    assert CONTEXT - len(prompt) < 30
    assert status == 200 and answer["usage"]["completion_tokens"] <= CONTEXT - len(prompt)
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= CONTEXT
    want = expected_text(model, tokenizer, prompt, CONTEXT - len(prompt))
    assert answer["choices"][0]["text"] == want


def test_a_one_megabyte_prompt_is_refused_without_stalling_the_event_loop(served):
    server, reference, _, _ = served
    stalls, done = [], threading.Event()

    def probe_health():
        while not done.is_set():
            started = time.monotonic()
            server.get("/health")
            stalls.append(time.monotonic() - started)
            time.sleep(0.02)

    prober = threading.Thread(target=probe_health)
    prober.start()
    try:
        started = time.monotonic()
        for _ in range(2):
            assert_refused(server, "/v1/completions", {"prompt": "word " * 200_000, "max_tokens": 4}, 400,
                           "max_position_embeddings")
        tokenizing = time.monotonic() - started
    finally:
        done.set()
        prober.join()
    # the two 1 MB prompts are tokenized in a worker thread: /health keeps answering meanwhile (upstream
    # tokenized on the event loop and stalled it for about a second per prompt)
    print(f"two 1 MB prompts refused in {tokenizing:.1f} s; /health answered {len(stalls)} times meanwhile, "
          f"slowest {max(stalls) * 1000:.0f} ms")
    assert len(stalls) >= 5 and max(stalls) < max(0.5, tokenizing / 2), (max(stalls), tokenizing, len(stalls))
    assert server.complete() == reference


def test_a_client_that_disconnects_is_cancelled_streamed_or_not(served):
    server, reference, _, _ = served
    server.fault("slow", "0.2")  # 0.2 s per forward: 100 tokens would take 20 s
    try:
        for stream in (False, True):
            connection = open_stream(server, {"prompt": NORMAL_PROMPT, "max_tokens": 100, "temperature": 0,
                                              "stream": stream})
            wait_for(lambda: server.get("/health")[1].get("generations_in_flight") == 1, 10, "the request runs")
            connection.close()
            started = time.monotonic()
            wait_for(lambda: server.get("/health")[1]["generations_in_flight"] == 0, 5,
                     f"the scheduler drops the request of a client that left (stream={stream})")
            assert time.monotonic() - started < 5
            wait_for(lambda: server.get("/health")[1]["requests_in_flight"] == 0, 5, "the handler ended")
    finally:
        server.clear("slow")
    assert server.complete() == reference


def test_an_exception_in_a_forward_fails_that_request_alone(served):
    server, reference, _, _ = served
    server.fault("raise")
    status, answer = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert status == 500 and "injected fault in a forward pass" in answer["detail"], answer
    assert "keeps serving" in answer["detail"]
    status, health = server.get("/health")
    assert status == 200 and health["restarts"] == 0, health  # the worker never died
    assert server.complete() == reference


def test_a_dead_worker_is_restarted_and_health_says_so_meanwhile(served):
    server, reference, _, _ = served
    before = server.get("/health")[1]["restarts"]
    server.fault("slow-start", "2")  # the restart takes 2 s: long enough to see it
    server.fault("kill-worker")
    try:
        status, answer = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert status == 503, answer  # the request that met the dying worker is told so
        status, health = wait_for(lambda: (lambda h: h if h[0] == 503 else None)(server.get("/health")), 3,
                                  "/health reports the restart")
        assert health["status"] == "restarting" and "injected death" in health["reason"], health
        assert_refused(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}, 503, "restarting")
        wait_for(lambda: server.get("/health")[0] == 200, 30, "the worker is back")
    finally:
        server.clear("slow-start")
    health = server.get("/health")[1]
    assert health["restarts"] == before + 1 and "injected death" in health["last_worker_error"], health
    assert server.complete() == reference


def test_sigterm_stops_the_batching_server_within_seconds_with_requests_in_flight(served):
    """Last test of the shared server: it stops it."""
    server, _, _, _ = served
    server.fault("slow", "0.2")
    connections = [open_stream(server, {"prompt": NORMAL_PROMPT, "max_tokens": 100, "temperature": 0,
                                        "stream": stream}) for stream in (False, True)]
    wait_for(lambda: server.get("/health")[1].get("generations_in_flight") == 2, 10, "both requests run")
    sigterm(server, "continuous batching: SIGTERM with 2 requests in flight")
    for connection in connections:  # each client got an answer (an error), not a hang
        connection.settimeout(5)
        assert connection.recv(65536)
        connection.close()


@pytest.mark.integration
def test_without_continuous_batching(tmp_path):
    """--no-continuous-batching: the same refusals; per-request sampling; a disconnect stops generate(); a
    failing generate() fails alone; SIGTERM stops the server with a generation in flight."""
    model, tokenizer = make_checkpoint(tmp_path / "tiny-switchhead", "tiny-switchhead")
    reference = expected_text(model, tokenizer, tokenizer(NORMAL_PROMPT)["input_ids"], NORMAL_TOKENS)
    server = HostileServer(tmp_path / "tiny-switchhead", tmp_path / "faults", "--no-continuous-batching")
    try:
        assert server.complete() == reference
        for what, fields, status, words in COMPLETION_CASES:
            if "under batching" in what:
                continue
            body = {"prompt": NORMAL_PROMPT, "temperature": 0, **fields}
            if body["prompt"] is None:
                del body["prompt"]
            assert_refused(server, "/v1/completions", body, status, words)
        assert server.complete() == reference
        # what continuous batching refuses is honoured per request here: sampling, stop, a penalty
        sampled = {server.complete(temperature=1.0, seed=seed, max_tokens=16) for seed in (1, 2, 3)}
        assert len(sampled) > 1, sampled  # really sampled (upstream kept greedy decoding under temperature 1)
        assert server.complete(temperature=1.0, seed=7, max_tokens=16) == server.complete(temperature=1.0, seed=7,
                                                                                          max_tokens=16)
        assert server.complete() == reference

        # chat logit_bias with an integer value is the same bias as the float (upstream: HTTP 500 for the integer)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        answers = []
        for bias in ({"5": 100}, {"5": 100.0}, None):
            status, answer = server.post("/v1/chat/completions", {**chat, **({"logit_bias": bias} if bias else {})})
            assert status == 200, (bias, answer)
            answers.append(answer["choices"][0]["message"]["content"])
        assert answers[0] == answers[1] == tokenizer.decode([5] * 4) != answers[2], answers  # honoured, not ignored
        assert server.complete() == reference

        server.fault("slow", "0.3")  # one inference thread: an uncancelled 100-token request would block 30 s
        connection = open_stream(server, {"prompt": NORMAL_PROMPT, "max_tokens": 100, "temperature": 0})
        wait_for(lambda: server.get("/health")[1]["requests_in_flight"] == 1, 10, "the request runs")
        time.sleep(0.5)
        connection.close()
        wait_for(lambda: server.get("/health")[1]["requests_in_flight"] == 0, 5, "the handler ended")
        started = time.monotonic()
        server.clear("slow")
        assert server.complete() == reference
        assert time.monotonic() - started < 8  # generate() of the gone client stopped at its next token

        server.fault("raise")
        status, answer = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert status == 500 and "injected fault" in answer["detail"], answer
        assert server.complete() == reference

        server.fault("slow", "0.2")
        connection = open_stream(server, {"prompt": NORMAL_PROMPT, "max_tokens": 100, "temperature": 0,
                                          "stream": True})
        wait_for(lambda: server.get("/health")[1]["requests_in_flight"] == 1, 10, "the request runs")
        sigterm(server, "one generate() per request: SIGTERM with a stream in flight")
        connection.settimeout(5)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
        assert b"stopped before its end" in received  # the stream ends with an error, not as if complete
        connection.close()
    finally:
        server.stop()


# ================================================================================================ training
SETTINGS = ["--block-size", "32", "--batch-size", "8", "--warmup-steps", "0", "--log-every", "1", "--eval-every",
            "100", "--eval-batches", "2", "--save-every", "2", "--keep-checkpoints", "3", "--no-progress",
            "--no-tensorboard"]


def train_args(corpus, output: Path, steps: int, *extra: str) -> list[str]:
    data, tokenizer = corpus
    # dropout on: the RNG state decides the continuation, so a resume is exact only if it is restored
    return ["train", "--preset", "tiny-switchhead-xl", "--set", "xl_memory_length=16", "--set", "hidden_dropout=0.1",
            "--data", data, "--tokenizer", tokenizer, "--output-dir", str(output), "--max-steps", str(steps),
            *SETTINGS, *extra]


def one_error_line(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> Path:
    """A 4-step run of the XL preset (checkpoints at steps 2 and 4); tests work on copies of it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(train_args(corpus, run, 4)) == 0
    return run


class Payload:
    """Unpickling this runs code: it creates the file `marker` (what an attacker's os.system would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def plant(path: Path, marker: Path) -> None:
    """Replace `path` by a pickle that runs code when loaded (torch's zip format for .bin/.pt, plain for .pkl)."""
    if path.suffix == ".pkl":
        path.write_bytes(pickle.dumps({"random_state": Payload(marker)}))
    else:
        torch.save({"state": Payload(marker)}, path)
    with pytest.raises(Exception):  # the restricted loader refuses it ...
        torch.load(path, weights_only=True)
    assert not marker.exists()  # ... and ran nothing


READ_BY_RESUME = ["optimizer.bin", "model.safetensors", "rng_state_0.safetensors", "xl_memory_0.safetensors",
                  "random_states_0.pkl", "xl_memory_0.pt"]  # the last two: names of the older format, planted


@pytest.mark.parametrize("manifest", [True, False], ids=["with-manifest", "without-manifest"])
def test_a_code_running_pickle_planted_in_any_file_a_resume_reads_runs_nothing(corpus, finished, tmp_path, capsys,
                                                                                manifest):
    marker = tmp_path / "code-ran"
    for name in READ_BY_RESUME:
        run = tmp_path / f"run-{name}"
        shutil.copytree(finished, run)
        for folder in checkpoint_dirs(str(run)):  # every checkpoint, so no intact one is left to fall back to
            plant(Path(folder) / name, marker)
            if not manifest:
                (Path(folder) / MANIFEST).unlink()
        code = main(train_args(corpus, run, 6, "--resume"))
        err = capsys.readouterr().err
        assert not marker.exists(), f"code ran from a planted {name}"
        assert "Traceback" not in err, err
        if name in ("random_states_0.pkl", "xl_memory_0.pt") and not manifest:
            # a file of the older format beside the new one is never read (the new one is, and resumes exactly)
            assert code == 0, (name, err)
        else:
            assert code == 2, (name, code, err)
            assert name in err or "no intact checkpoint" in err, (name, err)
    assert not marker.exists()


def test_an_older_checkpoints_pickled_rng_state_needs_allow_pickle_only_when_unsafe(corpus, finished, tmp_path,
                                                                                   capsys):
    """Checkpoints of the older format keep their RNG state in Accelerate's pickle: a genuine one loads with the
    restricted loader (exact resume, no flag); a code-running one is refused without --allow-pickle."""
    import random

    import numpy as np

    from switchhead.training.checkpoint_files import read_rng_state

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    newest = Path(checkpoint_dirs(str(run))[-1])
    state = read_rng_state(str(newest), 0)
    (newest / "rng_state_0.safetensors").unlink()
    (newest / MANIFEST).unlink()  # older checkpoints may have no manifest either
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.save({"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": state["torch_cpu"]}, newest / "random_states_0.pkl")  # as Accelerate wrote it
    assert main(train_args(corpus, run, 6, "--resume")) == 0
    assert not (run / "events.log").exists() or "inexact" not in (run / "events.log").read_text()
    reference = tmp_path / "reference"  # the same resume from the new format
    shutil.copytree(finished, reference)
    assert main(train_args(corpus, reference, 6, "--resume")) == 0
    capsys.readouterr()
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()  # exact

    run = tmp_path / "run-planted"
    shutil.copytree(finished, run)
    marker = tmp_path / "code-ran"
    for folder in checkpoint_dirs(str(run)):
        (Path(folder) / "rng_state_0.safetensors").unlink()
        (Path(folder) / MANIFEST).unlink()
        plant(Path(folder) / "random_states_0.pkl", marker)
    assert main(train_args(corpus, run, 6, "--resume")) == 2
    line = one_error_line(capsys)
    assert "--allow-pickle" in line and "random_states_0.pkl" in line and "restricted loader" in line, line
    assert not marker.exists()


def test_an_rng_state_that_does_not_load_stops_the_resume_unless_inexact_resume(corpus, finished, tmp_path, capsys):
    from safetensors.torch import save_file

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for folder in checkpoint_dirs(str(run)):  # a well-formed file of the wrong content, no manifest to catch it
        save_file({"torch_cpu": torch.zeros(3)}, Path(folder) / "rng_state_0.safetensors", metadata={"format": "x"})
        (Path(folder) / MANIFEST).unlink()
    assert main(train_args(corpus, run, 6, "--resume")) == 2
    line = one_error_line(capsys)
    assert "RNG state" in line and "rng_state_0.safetensors" in line and "--inexact-resume" in line, line
    assert main(train_args(corpus, run, 6, "--resume", "--inexact-resume")) == 0
    assert "inexact resume from" in (run / "events.log").read_text()


@pytest.mark.integration
def test_a_second_writer_is_refused_naming_the_first_and_a_killed_writer_blocks_nobody(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "switchhead.cli", *train_args(corpus, run, 100_000)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (run / LOCK_NAME).exists() and (run / "log.csv").exists(), 120, "the first run writes")
        assert main(train_args(corpus, run, 4, "--overwrite")) == 2
        line = one_error_line(capsys)
        assert f"process {first.pid}" in line and "switchhead train" in line and "one writer" in line, line
        assert main(train_args(corpus, run, 4, "--resume")) == 2
        assert f"process {first.pid}" in one_error_line(capsys)
    finally:
        first.kill()  # SIGKILL: no clean-up code runs, the kernel drops the lock
        first.wait()
    assert (run / LOCK_NAME).exists()  # the dead writer's lock file is left behind ...
    assert main(train_args(corpus, run, 4, "--overwrite")) == 0  # ... and blocks nobody
    capsys.readouterr()
    steps = [int(row["step"]) for row in csv.DictReader(open(run / "log.csv"))]
    assert steps == [1, 2, 3, 4]  # one run's rows, none interleaved
    assert not (run / LOCK_NAME).exists()  # a clean exit removes it


@pytest.mark.integration
def test_a_full_disk_during_a_save_exits_2_and_every_earlier_checkpoint_resumes(corpus, finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = {Path(p).name: sorted(os.listdir(p)) for p in checkpoint_dirs(str(run))}
    limit = 64 * 1024  # files may not grow past 64 KiB: the model and optimizer files of the next save fail
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            "from switchhead.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code, *train_args(corpus, run, 6, "--resume")], env=env,
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("switchhead train: error: cannot write the checkpoint of step 6") and str(run) in lines[0]
    after = {Path(p).name: sorted(os.listdir(p)) for p in checkpoint_dirs(str(run))}
    assert after == before and not [n for n in os.listdir(run / "checkpoints") if n.startswith(".tmp")]
    assert main(train_args(corpus, run, 6, "--resume")) == 0  # space is back: resume finishes the run


def test_bad_data_and_a_damaged_tokenizer_exit_2_and_leave_the_folder_reusable(corpus, tmp_path, capsys):
    data, tokenizer = corpus
    binary = tmp_path / "data.txt"
    binary.write_bytes(os.urandom(4096) + b"\0")
    run = tmp_path / "run"
    assert main(["train", "--data", str(binary), "--output-dir", str(run), "--max-steps", "2", *SETTINGS]) == 2
    assert "is binary" in one_error_line(capsys) and not run.exists()
    broken = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, broken)
    (broken / "tokenizer.json").write_text((broken / "tokenizer.json").read_text()[:500])
    args = ["train", "--data", data, "--output-dir", str(run), "--max-steps", "2", *SETTINGS]
    assert main([*args, "--tokenizer", str(broken)]) == 2
    assert "does not load" in one_error_line(capsys)
    assert not run.exists()  # no run marker left behind: the corrected rerun is not refused
    assert main([*args, "--tokenizer", tokenizer]) == 0


@pytest.mark.integration
def test_commands_print_nothing_but_their_own_line_on_stderr(tmp_path):
    """With the test extras installed (torchao among them) importing switchhead used to print four warning lines.
    One fresh process (the noise came at import): a command that succeeds, a marker, a command that fails."""
    code = ("import sys; from switchhead.cli import main; assert main(['flops', 'tiny-switchhead']) == 0; "
            "print('--', file=sys.stderr); sys.exit(main(['generate', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], env={**os.environ,
                            "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("--\n"), result.stderr  # nothing before the successful command's end
    assert result.stderr[3:].startswith("switchhead generate: error: model folder") \
        and result.stderr[3:].count("\n") == 1, result.stderr


def test_commands_that_write_a_folder_refuse_one_another_writer(tmp_path, capsys):
    """finetune, convert and upcycle take the same lock as train: a held one is refused naming its holder."""
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.integrity import FolderLock

    model = tmp_path / "model"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(model)
    text = tmp_path / "text.txt"
    text.write_text("lobsters walk along the sandy floor.\n" * 200)
    out = tmp_path / "out"
    holder = f"process {os.getpid()}"
    capsys.readouterr()  # save_pretrained's progress bar
    with FolderLock(str(out), "train"):  # inside the folder, as train and finetune lock theirs
        assert main(["finetune", str(model), "--data", str(text), "--output-dir", str(out)]) == 2
        assert holder in one_error_line(capsys, "finetune")
    assert not out.exists()  # released, and the folder it had created is gone
    with FolderLock(str(out), "convert", inside=False):  # beside the path, as convert and upcycle lock theirs
        assert main(["convert", "authors-to-hf", str(text), str(out)]) == 2
        assert holder in one_error_line(capsys, "convert")
        assert main(["upcycle", str(model), str(out), "--heads", "1", "--experts", "2", "--k", "1"]) == 2
        assert holder in one_error_line(capsys, "upcycle")
    assert not out.exists() and not list(tmp_path.glob(f".out{LOCK_NAME}"))


def test_the_paged_cache_bounds_a_request_as_the_context_does(served):
    """A paged cache smaller than the context (here 32 tokens, as `--cb-num-blocks 2 --cb-block-size 16` gives):
    prompt + max_tokens must fit it, and a missing max_tokens is filled with the room left in it. The same
    checker the server runs, in this process, with the served model's tokenizer."""
    from switchhead.serving import RequestChecker, RequestRefused, ServerState

    _, _, model, tokenizer = served
    state = ServerState.__new__(ServerState)  # the facts the checker reads, without a server
    state.checkpoint, state.tokenizer, state.vocab_size, state.context = "m", tokenizer, model.config.vocab_size, 128
    state.cache_tokens, state.continuous_batching, state.chat_template_kwargs = 32, False, {}
    checker = RequestChecker(state)
    prompt = len(tokenizer(NORMAL_PROMPT)["input_ids"])
    with pytest.raises(RequestRefused, match=r"exceed the 32 tokens a sequence holds here \(the paged cache"):
        checker.check("/v1/completions", json.dumps({"prompt": NORMAL_PROMPT, "max_tokens": 40}).encode())
    body, info = checker.check("/v1/completions", json.dumps({"prompt": NORMAL_PROMPT}).encode())
    assert json.loads(body)["max_tokens"] == 32 - prompt and info.sampling is None
    body, info = checker.check("/v1/completions", json.dumps({"prompt": NORMAL_PROMPT, "temperature": 0.5}).encode())
    assert info.sampling is True  # without continuous batching, sampling is honoured per request


# ================================================================================================ round three
def test_the_lock_never_writes_through_a_link_or_into_another_file(corpus, finished, tmp_path, capsys):
    """A symbolic link at the lock's path (to a user's file) is refused by train and upcycle, and the file keeps its
    bytes; so are a FIFO (which would block) and a hard link to the user's file (which O_NOFOLLOW cannot see)."""
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.integrity import FolderLock, FolderLockPathInvalid

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / LOCK_NAME).symlink_to(notes)
    assert main(train_args(corpus, run, 6, "--resume")) == 2
    assert "is a symbolic link" in one_error_line(capsys)
    assert notes.read_text() == "my notes\n" and (run / LOCK_NAME).is_symlink()

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense")).save_pretrained(dense)
    capsys.readouterr()
    beside = tmp_path / f".up{LOCK_NAME}"  # upcycle locks beside its output, in a folder that may be shared
    beside.symlink_to(notes)
    assert main(["upcycle", str(dense), str(tmp_path / "up"), "--heads", "2", "--experts", "2", "--k", "1"]) == 2
    assert "is a symbolic link" in one_error_line(capsys, "upcycle")
    assert notes.read_text() == "my notes\n" and not (tmp_path / "up").exists()

    folder = tmp_path / "folder"
    folder.mkdir()
    os.mkfifo(folder / LOCK_NAME)
    with pytest.raises(FolderLockPathInvalid, match="is not a regular file"):
        FolderLock(str(folder), "train").acquire()
    (folder / LOCK_NAME).unlink()
    os.link(notes, folder / LOCK_NAME)
    with pytest.raises(FolderLockPathInvalid, match="hard links"):
        FolderLock(str(folder), "train").acquire()
    assert notes.read_text() == "my notes\n"


def test_a_resume_writes_through_no_link_planted_at_a_temporary_name(corpus, finished, tmp_path, capsys):
    """The run's log and manifests are replaced through fresh temporary names (`atomic_file`): links planted at the
    fixed names used before (`log.csv.tmp`, `SHA256SUMS.tmp`) are never written through."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for planted in (run / "log.csv.tmp", run / f"{MANIFEST}.tmp"):
        planted.symlink_to(notes)
    assert main(train_args(corpus, run, 6, "--resume")) == 0
    capsys.readouterr()
    assert notes.read_text() == "my notes\n"
    assert not [name for name in os.listdir(run) if name.startswith(".partial-")]


def test_export_overwrite_keeps_the_old_file_until_the_new_one_is_complete(tmp_path, capsys, monkeypatch):
    """--overwrite replaces the file by a rename at the end: an export that dies half way leaves the old file as it
    was (it used to be deleted first) and no temporary file; a finished one replaces it."""
    model = tmp_path / "model"
    save_hub_folder(model, "tiny-switchhead")
    previous = tmp_path / "prev.onnx"
    previous.write_bytes(b"the user's previous export")

    def killed(*args, **kwargs):
        assert previous.read_bytes() == b"the user's previous export"  # still whole while the export runs
        raise KeyboardInterrupt  # as a kill during the export would end it

    with monkeypatch.context() as patch:
        patch.setattr(torch.onnx, "export", killed)
        assert main(["export", str(model), str(previous), "--overwrite"]) == 130
    assert previous.read_bytes() == b"the user's previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "prev.onnx"]  # no temporary file left
    assert main(["export", str(model), str(previous), "--overwrite"]) == 0
    import onnx

    assert onnx.load(str(previous)).graph.output[0].name == "logits"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "prev.onnx"]
    capsys.readouterr()


def _damage(folder: Path, how: str, marker: Path | None = None) -> None:
    """Damage a saved tiny model folder in place (see test_every_command_refuses_a_damaged_model_folder)."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    if how == "nan":
        key = next(k for k in sorted(tensors) if k.endswith("q_proj.weight"))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "pickle-only":
        weights.unlink()
        torch.save({"state": Payload(marker)}, folder / "pytorch_model.bin")
    elif how == "no-weights":
        weights.unlink()
    elif how == "shapes":
        config = json.loads((folder / "config.json").read_text())
        config["intermediate_size"] = config.get("intermediate_size", 128) * 2
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "million-layers":
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] = 10**6
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "old-and-new-names":
        old = next(k for k in sorted(tensors) if k.endswith("mlp.keys"))
        tensors[old.replace("mlp.keys", "mlp.experts.expert_keys")] = tensors[old] + 1
        save_file(tensors, weights, metadata={"format": "pt"})


DAMAGES = [  # (how, preset, words of the refusal)
    ("nan", "tiny-switchhead", "NaN or infinite"),
    ("pickle-only", "tiny-switchhead", "only as pytorch_model.bin, a pickle, which is never loaded"),
    ("no-weights", "tiny-switchhead", "it holds no weights"),
    ("shapes", "tiny-switchhead", "the weights do not belong to this config.json"),
    ("million-layers", "tiny-switchhead", "num_hidden_layers 1000000, but the weights hold 2 layers"),
    ("old-and-new-names", "tiny-switchall", "with different values; which one is meant cannot be told"),
]


@pytest.mark.parametrize("how,preset,words", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_every_command_refuses_a_damaged_model_folder_in_one_line(tmp_path, capsys, how, preset, words):
    """generate, eval, export, finetune, serve and upcycle run the same check before loading
    (`switchhead.integrity.check_saved_model`): exit 2 and one line naming the problem, nothing written, no code
    from a pickle run, no memory spent on 10^6 layers."""
    folder = tmp_path / "model"
    save_hub_folder(folder, preset)
    marker = tmp_path / "code-ran"
    _damage(folder, how, marker)
    text = tmp_path / "text.txt"
    text.write_text("lobsters walk along the sandy floor.\n" * 200)
    capsys.readouterr()
    commands = {
        "generate": ["generate", str(folder), "--max-new-tokens", "2"],
        "eval": ["eval", str(folder), "--perplexity", str(text)],
        "export": ["export", str(folder), str(tmp_path / "out.onnx")],
        "finetune": ["finetune", str(folder), "--data", str(text), "--output-dir", str(tmp_path / "adapter"),
                     "--max-steps", "1"],
        "serve": ["serve", str(folder), "--port", str(free_port())],
    }
    for command, argv in commands.items():
        started = time.monotonic()
        assert main(argv) == 2, (how, command)
        assert words in one_error_line(capsys, command), (how, command)
        assert time.monotonic() - started < 60, (how, command)
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "text.txt"]  # nothing written


def test_serve_verifies_a_run_folders_manifest_like_generate_and_eval(finished, tmp_path, capsys):
    """A bit flip in a training run's model.safetensors (the manifest no longer matches) stops serve before it
    starts; --no-verify skips the manifest but not the finite-weights check."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    tensors = load_file(run / "model.safetensors")
    key = sorted(tensors)[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, run / "model.safetensors", metadata={"format": "pt"})
    for command in (["serve", str(run), "--port", str(free_port())], ["generate", str(run)],
                    ["eval", str(run), "--tasks", "none"]):
        assert main(command) == 2
        assert "damaged or incomplete (changed model.safetensors)" in one_error_line(capsys, command[0])
    assert main(["serve", str(run), "--port", str(free_port()), "--no-verify"]) == 2
    assert "NaN or infinite" in one_error_line(capsys, "serve")


def test_sizes_past_the_machines_memory_are_refused_before_anything_is_allocated(corpus, tmp_path, capsys):
    """config sizes and the paged cache are computed on the meta device and compared with physical memory: each
    refusal comes in seconds, names what is too large, and writes nothing."""
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    data, tokenizer = corpus
    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense")).save_pretrained(dense)
    served_model = tmp_path / "served"
    save_hub_folder(served_model, "tiny-switchhead")
    capsys.readouterr()
    cases = [
        (["train", "--preset", "tiny-switchhead", "--set", f"hidden_size={10**9}", "--data", data, "--tokenizer",
          tokenizer, "--output-dir", str(tmp_path / "run"), *SETTINGS], "train", "the model to train"),
        (["train", "--preset", "tiny-switchhead", "--set", f"num_hidden_layers={10**6}", "--data", data,
          "--tokenizer", tokenizer, "--output-dir", str(tmp_path / "run"), *SETTINGS], "train", "num_hidden_layers"),
        (["upcycle", str(dense), str(tmp_path / "up"), "--heads", "2", "--experts", str(10**9), "--k", "1"],
         "upcycle", "num_attention_experts 1000000000"),
        (["serve", str(served_model), "--port", str(free_port()), "--cb-num-blocks", str(10**9)], "serve",
         "--cb-num-blocks 1000000000: the paged KV cache needs"),
    ]
    for argv, command, words in cases:
        started = time.monotonic()
        assert main(argv) == 2, argv
        line = one_error_line(capsys, command)
        assert words in line and "GiB, more than this machine's" in line, line
        assert time.monotonic() - started < 60, argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "served"]


def test_an_unverified_trainer_state_cannot_make_a_resume_loop(corpus, finished, tmp_path, capsys):
    """num_processes 10^12 in a trainer_state.json that no manifest vouches for: refused at once, not 10^12 reads."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for folder in checkpoint_dirs(str(run)):
        state = json.loads((Path(folder) / "trainer_state.json").read_text())
        state["num_processes"] = 10**12
        (Path(folder) / "trainer_state.json").write_text(json.dumps(state))
        (Path(folder) / MANIFEST).unlink()
    started = time.monotonic()
    assert main(train_args(corpus, run, 6, "--resume")) == 2
    line = one_error_line(capsys)
    assert "num_processes 1000000000000 is not an integer in [1, 1048576]" in line, line
    assert time.monotonic() - started < 60


def test_upcycle_refuses_nan_router_noise_and_weights_that_do_not_fit(tmp_path, capsys):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    dense = tmp_path / "dense"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense")).save_pretrained(dense)
    capsys.readouterr()
    args = ["--heads", "2", "--experts", "2", "--k", "1"]
    assert main(["upcycle", str(dense), str(tmp_path / "up"), *args, "--router-noise", "nan"]) == 2
    assert "--router-noise must be a finite number >= 0, got nan" in one_error_line(capsys, "upcycle")
    config = json.loads((dense / "config.json").read_text())
    config["hidden_size"] = 128  # the weights were saved for 64
    (dense / "config.json").write_text(json.dumps(config))
    assert main(["upcycle", str(dense), str(tmp_path / "up"), *args]) == 2
    assert "the weights do not belong to this config.json" in one_error_line(capsys, "upcycle")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_options_are_refused_not_silently_replaced(tmp_path, capsys):
    """export --opset outside what the exporter writes (it wrote opset 18 instead); eval --context / --stride without
    --perplexity (ignored before); a --device this machine does not have (a traceback before)."""
    model = tmp_path / "model"
    save_hub_folder(model, "tiny-switchhead")
    capsys.readouterr()
    for opset in ("1", "99999", "-1"):
        assert main(["export", str(model), str(tmp_path / "out.onnx"), "--opset", opset]) == 2
        assert f"--opset {opset} is not one this exporter can write; choose 17 to" in one_error_line(capsys, "export")
    assert main(["eval", str(model), "--context", "100000"]) == 2
    assert "--context applies to --perplexity only" in one_error_line(capsys, "eval")
    assert main(["eval", str(model), "--tasks", "none", "--stride", "4"]) == 2
    assert "--stride applies to --perplexity only" in one_error_line(capsys, "eval")
    text = tmp_path / "text.txt"
    text.write_text("lobsters walk along the sandy floor.\n" * 20)
    assert main(["eval", str(model), "--perplexity", str(text), "--device", "tpu:7"]) == 2
    assert "--device 'tpu:7' is not a device of this machine" in one_error_line(capsys, "eval")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "text.txt"]


def test_the_exporter_writes_the_asked_opset_or_nothing(tmp_path):
    """torch's exporter falls back to its own opset (with a warning only) where it cannot convert the graph; the
    file is checked before it is renamed into place."""
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.conversion import ConversionError
    from switchhead.conversion.export import to_onnx

    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-dense")).eval()
    real = torch.onnx.export

    def falls_back(*args, opset_version=None, **kwargs):  # what the exporter does when conversion fails
        return real(*args, opset_version=None, **kwargs)

    torch.onnx.export = falls_back
    try:
        with pytest.raises(ConversionError, match="could not convert the graph to opset 21"):
            to_onnx(model, str(tmp_path / "m.onnx"), opset_version=21)
    finally:
        torch.onnx.export = real
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_a_full_disk_during_the_second_save_of_a_run_exits_2_and_leaves_no_temporary_folder(corpus, tmp_path):
    """The first checkpoint is written, then the disk fills (here: files may not grow past 64 KiB from then on)."""
    run = tmp_path / "run"
    limit = 64 * 1024
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "from switchhead.training import trainer; save = trainer.save_checkpoint\n"
            "def save_then_fill(*args, **kwargs):\n"
            "    path = save(*args, **kwargs)\n"
            f"    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "    return path\n"
            "trainer.save_checkpoint = save_then_fill\n"
            "from switchhead.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code, *train_args(corpus, run, 4)], env=env, capture_output=True,
                            text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Writing model shards" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("switchhead train: error: cannot write the checkpoint of step 4"), lines[0]
    assert [Path(p).name for p in checkpoint_dirs(str(run))] == ["step-0000002"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step-0000002"]  # no .tmp-step-0000004


def test_a_failed_save_of_any_kind_leaves_no_temporary_folder(corpus, tmp_path, monkeypatch):
    """Whatever fails inside a checkpoint save (here an unexpected error, which keeps its traceback), the
    temporary folder goes; torch's zip writer reports a disk that fills between two records as 'unexpected pos',
    which is a write failure (one line, exit 2), as a real full tmpfs showed."""
    from switchhead.training import checkpoints

    assert checkpoints._write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8256 "
                                                   "vs 8148")) is not None
    assert checkpoints._write_failure(RuntimeError("shape mismatch")) is None
    run = tmp_path / "run"
    write = checkpoints.write_manifest
    calls = []

    def fails_on_the_second_checkpoint(folder, *args):
        if os.path.isfile(os.path.join(folder, checkpoints.CHECKPOINT_STATE)):  # a checkpoint's staging folder
            calls.append(folder)
            if len(calls) == 2:
                raise KeyError("an unexpected failure")
        return write(folder, *args)

    monkeypatch.setattr(checkpoints, "write_manifest", fails_on_the_second_checkpoint)
    with pytest.raises(KeyError):
        main(train_args(corpus, run, 4))
    assert sorted(os.listdir(run / "checkpoints")) == ["step-0000002"]


@pytest.mark.integration
def test_other_libraries_noise_stays_off_our_commands_stderr(corpus, finished, tmp_path):
    """bitsandbytes' 'Failed to load CPU gemm_4bit_forward' (at import, on CPUs with AVX512-BF16, where its Hub
    kernel cannot be fetched), Transformers' 'You are using a model of type' and torch's pickle-protocol warning
    (a planted pickle read by the restricted loader): one fresh process, then only our line."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    marker = tmp_path / "code-ran"
    for folder in checkpoint_dirs(str(run)):  # protocol 4: torch warns before refusing it
        (Path(folder) / "rng_state_0.safetensors").unlink()
        (Path(folder) / MANIFEST).unlink()
        (Path(folder) / "random_states_0.pkl").write_bytes(pickle.dumps({"x": Payload(marker)}, protocol=4))
    # the two log records are sent while the command runs (where the libraries' imports send them), so that the
    # test does not depend on this CPU's instruction set
    code = ("import logging, sys; import switchhead.cli as cli; build = cli.build_parser\n"
            "def build_and_log():\n"
            "    logging.getLogger('bitsandbytes.backends.cpu.ops').warning('Failed to load CPU gemm_4bit_forward "
            "from kernels-community: no network')\n"
            "    logging.getLogger('transformers.configuration_utils').warning('You are using a model of type "
            "`llama` to instantiate a model of type `switchhead`.')\n"
            "    return build()\n"
            "cli.build_parser = build_and_log\n"
            "sys.exit(cli.main(sys.argv[1:]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code, *train_args(corpus, run, 6, "--resume")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("switchhead train: error: "), result.stderr
    assert not marker.exists()
