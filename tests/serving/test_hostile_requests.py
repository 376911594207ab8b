"""Hostile request bodies and generation configs for the server without continuous batching: each gets HTTP 400
with one sentence naming the field (or is served correctly), never 500, and the server goes on.

Upstream handed these to `generate()`, which raised (HTTP 500): a per-request `generation_config` with an integer
`repetition_penalty` (Transformers' processor takes floats only), sampling (`do_sample`) at temperature 0, and a
request temperature below float32's range (1e-300, 5e-324: the logits are divided by 0). A model folder whose
generation_config.json holds `"repetition_penalty": 100` failed every request; it is now read as 100.0.

The checks run in this process on a `RequestChecker` over a stand-in server state (cheap, many cases); one server
subprocess (`--no-continuous-batching`) answers the hostile cases end to end.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from switchhead.serving.requests import (MIN_SAMPLING_TEMPERATURE, RequestChecker, RequestRefused,
                                         normalize_generation_config)


class _Tokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __call__(self, text):
        return {"input_ids": [ord(c) % 50 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, tokenize=True, return_dict=True,
                            **kwargs):
        return {"input_ids": [ord(c) % 50 for m in messages for c in m["content"]] or [1]}


def _checker(continuous_batching: bool = False) -> RequestChecker:
    state = SimpleNamespace(checkpoint="ckpt", continuous_batching=continuous_batching, vocab_size=64,
                            tokenizer=_Tokenizer(), chat_template_kwargs={}, cb_generation_config=None,
                            token_limit=lambda: (128, "the model's context"))
    return RequestChecker(state)


def _check(body: dict, path: str = "/v1/completions") -> dict:
    raw, _ = _checker().check(path, json.dumps(body).encode())
    return json.loads(raw)


def _refused(body, words: str, path: str = "/v1/completions") -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestRefused) as refused:
        _checker().check(path, raw)
    assert refused.value.status in (400, 422) and words in str(refused.value), str(refused.value)


PROMPT = {"prompt": "hello there", "max_tokens": 4}

REFUSED = [
    ({"temperature": 1e-300}, "temperature must be 0 (greedy) or at least"),
    ({"temperature": 5e-324}, "temperature must be 0 (greedy) or at least"),
    ({"temperature": 1e-5}, "temperature must be 0 (greedy) or at least"),
    ({"temperature": -1e-300}, "temperature must be in [0, 2]"),
    ({"temperature": 2.0000001}, "temperature must be in [0, 2]"),
    ({"temperature": 10**400}, "temperature must be in [0, 2]"),
    ({"temperature": "0.5"}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1e-320, "temperature": 0}, "temperature 0 asks for greedy decoding"),
    ({"frequency_penalty": -0.0001}, "frequency_penalty must be in [0, 2]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 10**30}, "exceed the 128 tokens"),
    ({"max_tokens": 4.0}, "max_tokens must be an integer"),
    ({"seed": -1}, "seed must be in [0,"),
    ({"seed": 2**63}, "seed must be in [0,"),
    ({"generation_config": json.dumps({"do_sample": True, "temperature": 0})}, "at temperature 0"),
    ({"generation_config": json.dumps({"do_sample": True, "temperature": 0.0})}, "at temperature 0"),
    ({"generation_config": json.dumps({"temperature": 1e-300})}, "generation_config.temperature must be 0"),
    ({"generation_config": json.dumps({"temperature": 5e-324})}, "generation_config.temperature must be 0"),
    ({"generation_config": json.dumps({"repetition_penalty": 0})}, "generation_config.repetition_penalty"),
    ({"generation_config": json.dumps({"repetition_penalty": 101})}, "generation_config.repetition_penalty"),
    ({"generation_config": json.dumps({"repetition_penalty": -1})}, "generation_config.repetition_penalty"),
    ({"generation_config": json.dumps({"top_k": 2.5})}, "generation_config.top_k must be an integer"),
    ({"generation_config": json.dumps({"do_sample": 1})}, "generation_config.do_sample must be true or false"),
    ({"generation_config": json.dumps({"max_new_tokens": 0})}, "generation_config.max_new_tokens"),
    ({"generation_config": json.dumps({"eos_token_id": 3})}, "generation_config.eos_token_id is not accepted"),
    ({"generation_config": "[1, 2]"}, "generation_config must be a JSON object"),
    ({"generation_config": "{"}, "generation_config is not valid JSON"),
    ({"generation_config": "[" * 100_000}, "generation_config is not valid JSON"),
    ({"generation_config": {"temperature": 1}}, "generation_config must be a JSON string of an object"),
    ({"generation_config": json.dumps({"temperature": float("nan")})}, "generation_config.temperature must be a "
                                                                       "number"),
    ({"generation_config": json.dumps({"top_p": float("inf")})}, "generation_config.top_p must be a number"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": ["a", "b"]}, "prompt must be one string"),
    ({"prompt": "\ud800"}, "not valid Unicode"),
    ({"stop": ""}, "stop must be a non-empty string"),
    ({"stop": ["a"] * 5}, "stop must be a non-empty string"),
    ({"n": 2}, "n must be 1"),
    ({"logprobs": True}, "logprobs must be false"),
]


@pytest.mark.parametrize("fields, words", REFUSED, ids=[json.dumps(case[0])[:50] for case in REFUSED])
def test_a_hostile_completion_request_is_refused_naming_the_field(fields, words):
    _refused({**PROMPT, **fields}, words)


def _nested(depth: int) -> bytes:
    return json.dumps({"prompt": "x", "a": json.loads("[" * depth + "]" * depth)}).encode()


@pytest.mark.parametrize("raw, words", [(b"[1, 2, 3]", "the body must be a JSON object"),
                                        (b"\xff\xfe", "not valid JSON"),
                                        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
                                        (_nested(40), "nested deeper"),
                                        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON")],
                         ids=["list", "bytes", "100000-deep", "40-deep", "5000-digit"])
def test_bodies_that_are_not_one_json_object_are_refused(raw, words):
    _refused(raw, words)


def test_an_integer_penalty_in_a_request_config_is_served_as_the_float():
    body = _check({**PROMPT, "generation_config": json.dumps({"repetition_penalty": 100, "temperature": 1,
                                                               "top_p": 1, "top_k": 5})})
    config = json.loads(body["generation_config"])
    assert config == {"repetition_penalty": 100.0, "temperature": 1.0, "top_p": 1.0, "top_k": 5}
    assert isinstance(config["repetition_penalty"], float) and isinstance(config["top_k"], int)
    from transformers import GenerationConfig
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    RepetitionPenaltyLogitsProcessor(GenerationConfig(**config).repetition_penalty)  # raised for the integer


def test_temperature_zero_is_greedy_and_the_lowest_sampling_temperature_is_accepted():
    assert _check({**PROMPT, "temperature": 0})["temperature"] == 0
    assert _check({**PROMPT, "temperature": MIN_SAMPLING_TEMPERATURE})["temperature"] == MIN_SAMPLING_TEMPERATURE
    # a request temperature overrides the config's, so greedy at 0 wins over do_sample (upstream sets do_sample off)
    _check({**PROMPT, "temperature": 0, "generation_config": json.dumps({"do_sample": True, "temperature": 0})})


def test_the_models_generation_config_is_made_servable_or_refused_at_start():
    from transformers import GenerationConfig

    config = GenerationConfig(repetition_penalty=100, temperature=1, top_p=1)
    normalize_generation_config(config)
    assert isinstance(config.repetition_penalty, float) and config.repetition_penalty == 100.0
    assert isinstance(config.temperature, float) and isinstance(config.top_p, float)
    normalize_generation_config(GenerationConfig(do_sample=False, temperature=0.0))  # greedy: temperature unused
    for temperature in (0.0, 1e-300):
        sampling = GenerationConfig(do_sample=True)
        sampling.temperature = temperature
        with pytest.raises(ValueError, match="samples .do_sample true. at temperature"):
            normalize_generation_config(sampling)


@pytest.mark.integration
def test_the_server_answers_400_not_500_and_serves_an_integer_penalty_from_the_folder(tmp_path):
    """A real server without continuous batching over a folder whose generation_config.json holds
    `"repetition_penalty": 100` (an integer): requests are served, each hostile one gets 400, the server stays up."""
    import torch

    from helpers.server import Server, make_checkpoint

    folder = tmp_path / "ckpt"
    model, tokenizer = make_checkpoint(folder, "tiny-switchhead")
    config_file = folder / "generation_config.json"
    generation = json.loads(config_file.read_text()) if config_file.exists() else {}
    generation.update(repetition_penalty=100, do_sample=False)
    config_file.write_text(json.dumps(generation))
    prompt = "The quick brown fox jumps over"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=6, do_sample=False, repetition_penalty=100.0,
                             pad_token_id=tokenizer.pad_token_id)
    reference = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    server = Server(str(folder), "--no-continuous-batching", log_dir=str(tmp_path))
    try:
        server.wait_ready()
        import urllib.error
        import urllib.request

        def post(body: dict) -> tuple[int, dict]:
            request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read() or b"{}")

        status, answer = post({"prompt": prompt, "max_tokens": 6})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference  # the folder's penalty, applied as 100.0
        for fields in ({"temperature": 1e-300}, {"temperature": 5e-324},
                       {"generation_config": json.dumps({"do_sample": True, "temperature": 0})},
                       {"generation_config": json.dumps({"temperature": 1e-300, "do_sample": True})}):
            status, answer = post({"prompt": prompt, "max_tokens": 6, **fields})
            assert status == 400, (fields, status, answer)
            assert "temperature" in json.dumps(answer), answer
        status, answer = post({"prompt": prompt, "max_tokens": 6,
                               "generation_config": json.dumps({"repetition_penalty": 100, "max_new_tokens": 6})})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference
        assert server.health() == 200
    finally:
        server.stop()
