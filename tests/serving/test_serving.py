"""`switchhead serve`: Transformers' OpenAI-compatible server on a saved checkpoint, over real HTTP.

The server runs as a subprocess on a free port (always stopped at the end) and is spoken to with the `openai`
client: /v1/completions and /v1/chat/completions, streamed and not, 16 concurrent requests, all greedy outputs
equal to `generate()` in this process. Bad requests get HTTP 4xx with a message and the server keeps serving.
Two checkpoints: a tiny SwitchAll with the package installed, and a published-style Hub folder of the XL
SwitchHead loaded with `--trust-remote-code` (its class from the folder's own code, through `auto_map`).
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import transformers

try:
    import fastapi  # noqa: F401
    import openai
except ImportError as error:  # fail, not skip: the test extra pins them
    raise ImportError(f"{error}; the serving tests need the serve dependencies: pip install -e '.[test]'") from error

from helpers.network import free_port  # noqa: E402
from helpers.server import MAX_TOKENS, Server, expected_text, make_checkpoint  # noqa: E402

PROMPTS = ["Hello world", "The quick brown fox jumps over", "A", "In 1905 Einstein published four papers on",
           "def main():", "Serving models is", "one two three four five six seven eight nine ten", "Why"]


def chat_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, model, tokenizer) for a tiny SwitchAll served with the package installed."""
    from switchhead.serving.server import upstream_server_gap

    if upstream_server_gap():  # a release outside serve's range (the compatibility matrix's newest, once)
        pytest.skip(f"transformers {transformers.__version__} has another server than the one `switchhead serve` "
                    f"wraps, which it refuses: test_serve_refuses_a_transformers_server_it_does_not_wrap holds that")
    path = tmp_path_factory.mktemp("serve") / "tiny-switchall"
    model, tokenizer = make_checkpoint(path, "tiny-switchall")
    server = Server(str(path))
    try:
        server.wait_ready()
        yield server, model, tokenizer
    finally:
        server.stop()


def complete(server, prompt: str, stream: bool = False, **kwargs) -> str:
    args = dict(model=server.checkpoint, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kwargs)
    if not stream:
        return server.client.completions.create(**args).choices[0].text
    return "".join(chunk.choices[0].text for chunk in server.client.completions.create(stream=True, **args)
                   if chunk.choices)


def chat(server, content: str, stream: bool = False) -> str:
    args = dict(model=server.checkpoint, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
                temperature=0)
    if not stream:
        return server.client.chat.completions.create(**args).choices[0].message.content or ""
    return "".join(chunk.choices[0].delta.content or "" for chunk in
                   server.client.chat.completions.create(stream=True, **args) if chunk.choices)


def test_serve_refuses_a_transformers_server_it_does_not_wrap(tmp_path, monkeypatch, capsys):
    """Where Transformers' server lacks what serve subclasses (Transformers 5.25 rebuilt it), `switchhead serve`
    exits 2 in one line naming the releases to install, before it listens; the Python entry point raises the
    same. On a release it wraps, one of the names it needs is made to be missing."""
    import switchhead.serving.server as server_module
    from switchhead import transformers_compat as compat
    from switchhead.cli import main

    if not server_module.upstream_server_gap():
        names = {**server_module.UPSTREAM_NAMES,
                 "transformers.cli.serving.utils": ("CBGenerateManager", "RenamedInALaterRelease")}
        monkeypatch.setattr(server_module, "UPSTREAM_NAMES", names)
        assert server_module.upstream_server_gap() == ["transformers.cli.serving.utils.RenamedInALaterRelease"]
    wanted = (f"switchhead serve wraps the server of transformers {compat.OLDEST_SUPPORTED} to {compat.NEWEST_TESTED}"
              f", and transformers {transformers.__version__} has another one (no ")
    with pytest.raises(ImportError, match=re.escape(wanted)):
        server_module.serve(str(tmp_path / "never-loaded"))
    path = tmp_path / "tiny-switchall"
    make_checkpoint(path, "tiny-switchall")
    capsys.readouterr()
    assert main(["serve", str(path), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("switchhead serve: error: " + wanted) and "\n" not in err, err
    assert err.endswith(f"pip install 'transformers{compat.SUPPORTED_RANGE}'"), err


@pytest.mark.integration  # serves a model
def test_completions_and_chat_equal_generate(served):
    server, model, tokenizer = served
    for prompt in PROMPTS[:3]:
        want = expected_text(model, tokenizer, tokenizer(prompt)["input_ids"])
        assert complete(server, prompt) == want, prompt
        assert complete(server, prompt, stream=True) == want, prompt
        want_chat = expected_text(model, tokenizer, chat_ids(tokenizer, prompt))
        assert chat(server, prompt) == want_chat, prompt
        assert chat(server, prompt, stream=True) == want_chat, prompt


@pytest.mark.integration  # serves a model
def test_sixteen_concurrent_requests(served):
    server, model, tokenizer = served
    jobs = [(kind, PROMPTS[i % len(PROMPTS)], i % 4 == 1) for i, kind in
            enumerate(["completion", "chat"] * 8)]  # 16 requests, a quarter of them streamed
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda job: (complete if job[0] == "completion" else chat)(
            server, job[1], stream=job[2]), jobs))
    for (kind, prompt, _), answer in zip(jobs, answers):
        ids = tokenizer(prompt)["input_ids"] if kind == "completion" else chat_ids(tokenizer, prompt)
        assert answer == expected_text(model, tokenizer, ids), (kind, prompt)


@pytest.mark.integration  # serves a model
def test_bad_requests_get_4xx_and_server_keeps_serving(served):
    server, model, tokenizer = served
    context = model.config.max_position_embeddings
    bad = [
        dict(prompt="word " * (context + 10)),  # longer than the context
        dict(max_tokens=-1),
        dict(model="no-such-model"),
    ]
    for override in bad:
        args = dict(model=server.checkpoint, prompt="Hello", max_tokens=4, temperature=0) | override
        with pytest.raises(openai.APIStatusError) as caught:
            server.client.completions.create(**args)
        assert 400 <= caught.value.status_code < 500, (override, caught.value.status_code)
        assert str(caught.value.body or caught.value.message), override  # a message, not an empty body
    with pytest.raises(openai.APIStatusError) as caught:
        server.client.chat.completions.create(model=server.checkpoint, max_tokens=-3,
                                              messages=[{"role": "user", "content": "Hi"}])
    assert 400 <= caught.value.status_code < 500
    with pytest.raises(openai.APIStatusError) as caught:  # the chat template pushes it past the context
        server.client.chat.completions.create(model=server.checkpoint, max_tokens=4,
                                              messages=[{"role": "user", "content": "word " * context}])
    assert 400 <= caught.value.status_code < 500
    request = urllib.request.Request(server.url + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught_http:
        urllib.request.urlopen(request, timeout=10)
    assert 400 <= caught_http.value.code < 500
    # still serving, still exact
    assert server.health() == 200
    assert complete(server, PROMPTS[0]) == expected_text(model, tokenizer, tokenizer(PROMPTS[0])["input_ids"])


@pytest.mark.integration
def test_hub_folder_with_trust_remote_code_xl(tmp_path):
    """A published-style folder (auto_map + copied code) of the XL variant, loaded with --trust-remote-code."""
    path = tmp_path / "hub-xl"
    model, tokenizer = make_checkpoint(path, "tiny-switchhead-xl")
    assert json.loads((path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    server = Server(str(path), "--trust-remote-code")
    try:
        server.wait_ready()
        with ThreadPoolExecutor(max_workers=4) as pool:  # concurrent: several requests share a paged batch
            answers = list(pool.map(lambda prompt: complete(server, prompt), PROMPTS[:4]))
        for prompt, answer in zip(PROMPTS[:4], answers):
            assert answer == expected_text(model, tokenizer, tokenizer(prompt)["input_ids"]), prompt
        assert chat(server, PROMPTS[1], stream=True) == expected_text(model, tokenizer,
                                                                      chat_ids(tokenizer, PROMPTS[1]))
    finally:
        server.stop()


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from switchhead.cli import main

    def run(*args):
        code = main(["serve", *args])
        return code, capsys.readouterr().err

    code, err = run(str(tmp_path / "missing"))
    assert code == 2 and err.startswith("switchhead serve: error:") and len(err.strip().splitlines()) == 1, err
    code, err = run(str(tmp_path))
    assert code == 2 and "config.json" in err, err
    (tmp_path / "config.json").write_text("{}")
    code, err = run(str(tmp_path), "--port", "70000")
    assert code == 2 and "--port" in err, err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = run(str(tmp_path), "--port", str(taken.getsockname()[1]))
    assert code == 2 and "cannot listen" in err, err


@pytest.mark.integration
def test_moeut_hub_folder_serves_greedy_tokens_of_generate(tmp_path):
    """MoEUT (shared blocks, one cache slot per application) from its folder's own code: one request, paged batch."""
    path = tmp_path / "hub-moeut"
    model, tokenizer = make_checkpoint(path, "tiny-moeut")
    server = Server(str(path), "--trust-remote-code")
    try:
        server.wait_ready()
        assert complete(server, PROMPTS[3]) == expected_text(model, tokenizer, tokenizer(PROMPTS[3])["input_ids"])
    finally:
        server.stop()
