"""Hostile input, fifth round: checks that a name could step around, publish's inputs, and the last tracebacks.

- A model folder reaches lm-eval as one keyword argument, never inside lm-eval's comma-joined argument string: a
  folder named `m,pretrained=evil` or `m,peft=adp` is evaluated itself.
- A Hub repository id (from the local Hub cache) gets exactly the checks a folder gets, on its cached snapshot.
- The error contract (exit 2, one stderr line `switchhead CMD: error: ...`) for the inputs that ended in a
  traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import tiny_model
from helpers.server import free_port

from switchhead.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny model folder (config.json, model.safetensors, the copied model code), seed 0."""
    folder = tmp_path_factory.mktemp("saved") / "model"
    tiny_model("tiny-switchhead").save_pretrained(folder)
    return folder


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


def poison(folder: Path) -> None:
    """One NaN in the folder's weights."""
    tensors = load_file(folder / "model.safetensors")
    name = sorted(key for key, value in tensors.items() if value.is_floating_point())[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# ============================================================================================= eval: lm-eval's string
@pytest.mark.parametrize("name", ["m,pretrained=evil", "m,peft=adp", "m,trust_remote_code=True"])
def test_a_folder_name_is_never_parsed_into_lm_eval_arguments(saved, tmp_path, monkeypatch, name):
    """lm-eval's HFLM gets the checked folder as `pretrained`, and no argument its name spells (another model, an
    adapter, trust in remote code)."""
    from lm_eval.models.huggingface import HFLM

    from switchhead.evaluation import zero_shot

    folder = tmp_path / name
    shutil.copytree(saved, folder)
    (tmp_path / "evil").mkdir()
    (tmp_path / "adp").mkdir()
    built = []

    class Stop(Exception):
        pass

    def record(self, **arguments):
        built.append(arguments)
        raise Stop

    monkeypatch.chdir(tmp_path)  # 'evil' and 'adp' resolve as relative folders, as a user's would
    monkeypatch.setattr(HFLM, "__init__", record)
    with pytest.raises(Stop):
        zero_shot.run_lm_eval(name, ["switchhead_lambada"])
    (arguments,) = built
    assert arguments["pretrained"] == name
    assert arguments.get("peft") is None and arguments["trust_remote_code"] is False


@pytest.mark.integration
def test_eval_of_a_folder_named_like_lm_eval_arguments_scores_that_folder(with_tokenizer, tmp_path, monkeypatch,
                                                                         capsys):
    """End to end: `eval` of 'm,pretrained=evil' scores the checked folder (the same numbers as a plain name),
    whatever 'evil' holds."""
    plain, tricky = tmp_path / "plain", tmp_path / "m,pretrained=evil"
    shutil.copytree(with_tokenizer, plain)
    shutil.copytree(with_tokenizer, tricky)
    evil = tmp_path / "evil"
    shutil.copytree(with_tokenizer, evil)
    poison(evil)
    monkeypatch.chdir(tmp_path)
    results = []
    for name in ("plain", "m,pretrained=evil"):
        assert main(["eval", name, "--tasks", "wikitext", "--limit", "1", "--output", f"{name}.json"]) == 0
        results.append(json.loads((tmp_path / f"{name}.json").read_text())["results"])
    capsys.readouterr()
    assert results[0] == results[1] and results[0]


# ============================================================================================= Hub ids
def cache_repo(cache: Path, repo_id: str, folder: Path) -> Path:
    """`folder` as the local Hub cache holds a downloaded repository: blobs named by hash, a snapshot of links to
    them, refs/main naming the snapshot. Returns the snapshot folder."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, root / "blobs" / blob)
            (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    # `serve` of a Hub id switches the process to offline loading: undone after the test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def serve_hub_id(repo_id: str, monkeypatch, *extra: str) -> tuple[int, list]:
    import switchhead.serving

    started = []
    monkeypatch.setattr(switchhead.serving, "serve", lambda checkpoint, **options: started.append(checkpoint))
    return main(["serve", repo_id, "--port", str(free_port()), *extra]), started


def test_a_cached_hub_repo_with_a_nan_weight_is_refused_like_a_folder(saved, hub_cache, tmp_path, monkeypatch,
                                                                      capsys):
    folder = tmp_path / "nan"
    shutil.copytree(saved, folder)
    poison(folder)
    cache_repo(hub_cache, "someone/nan-model", folder)
    code, started = serve_hub_id("someone/nan-model", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started
    assert "'someone/nan-model'" in line and "NaN" in line and str(hub_cache) not in line, line


def test_a_cached_hub_repo_holding_only_a_pickle_is_one_line(saved, hub_cache, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copyfile(saved / "config.json", folder / "config.json")
    torch.save(load_file(saved / "model.safetensors"), folder / "pytorch_model.bin")
    cache_repo(hub_cache, "someone/pickled", folder)
    code, started = serve_hub_id("someone/pickled", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started and "pytorch_model.bin" in line and "pickle" in line, line


def test_a_sound_cached_hub_repo_is_served_offline_from_the_snapshot_checked(saved, hub_cache, monkeypatch, capsys):
    import huggingface_hub.constants

    cache_repo(hub_cache, "someone/sound", saved)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    code, started = serve_hub_id("someone/sound", monkeypatch)
    assert code == 0 and started == ["someone/sound"], capsys.readouterr().err
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True  # no newer revision can be fetched behind the checks


def test_a_hub_id_missing_from_the_cache_is_refused_not_fetched_unchecked(hub_cache, monkeypatch, capsys):
    code, started = serve_hub_id("someone/absent", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started and "local Hub cache" in line and "hf download someone/absent" in line, line


# ============================================================================================= publish
class RecordingHub:
    """A stand-in for `huggingface_hub.HfApi` that records what it is asked to upload (and uploads nothing)."""

    instances: list["RecordingHub"] = []

    def __init__(self, token=None):
        self.files = {}
        RecordingHub.instances.append(self)

    def create_repo(self, **kwargs):
        pass

    def create_commit(self, *, operations, **kwargs):
        for operation in operations:
            source = operation.path_or_fileobj
            self.files[operation.path_in_repo] = source if isinstance(source, bytes) else \
                source.read() if hasattr(source, "read") else Path(source).read_bytes()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    RecordingHub.instances.clear()
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub)
    return RecordingHub.instances


NAN_RESULTS = [
    {"results": {"switchhead_lambada": {"acc": float("nan")}}},
    {"results": {"switchhead_wikitext2": {"word_perplexity": float("inf")}}},
    {"results": {}, "perplexity": [{"data": "a.txt", "protocol": "sliding", "context": 64, "stride": 32,
                                    "perplexity": float("nan"), "bits_per_byte": 1.0}]},
]


@pytest.mark.parametrize("command", ["card", "publish"])
@pytest.mark.parametrize("results", NAN_RESULTS, ids=["nan-acc", "inf-perplexity", "nan-run"])
def test_a_nan_or_infinite_metric_never_reaches_a_card(saved, tmp_path, hub, capsys, command, results):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))  # Python writes NaN / Infinity, as json.dumps of a float NaN does
    argv = [command, str(saved), *(["me/x"] if command == "publish" else ["--output", "-"]), "--results", str(path)]
    assert main(argv) == 2
    line = one_line(capsys, command)
    assert ("nan" in line or "inf" in line) and "not a result" in line, line
    assert not hub or not hub[0].files


@pytest.mark.parametrize("content", [
    {"token": "hf_secret", "user": "me"},  # a credentials file: no 'results' key at all
    {"results": [1, 2]},
    {"results": {"switchhead_lambada": 0.5}},
    {"results": {"switchhead_lambada": {"acc": "0.5"}}},
    {"results": {"switchhead_lambada": {"acc": True}}},
    {"results": {}, "perplexity": {"data": "a"}},
    {"results": {}, "perplexity": [{"data": 3, "protocol": "sliding", "context": 1, "perplexity": 1.0,
                                    "bits_per_byte": 1.0}]},
    {"results": {}, "perplexity": [{"data": "a", "protocol": "sliding", "context": "64", "perplexity": 1.0,
                                    "bits_per_byte": 1.0}]},
    {"results": {}, "limit": "all"},
    {"results": {}, "protocol": ["paper"]},
], ids=["credentials", "results-list", "task-number", "metric-string", "metric-bool", "runs-object",
        "run-data-number", "run-context-string", "limit-string", "protocol-list"])
@pytest.mark.parametrize("command", ["card", "publish"])
def test_results_of_another_shape_are_refused_and_never_uploaded(saved, tmp_path, hub, capsys, command, content):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(content))
    argv = [command, str(saved), *(["me/x", "--upload-results"] if command == "publish" else ["--output", "-"]),
            "--results", str(path)]
    assert main(argv) == 2
    line = one_line(capsys, command)
    assert "switchhead eval --output" in line, line
    assert not hub or not hub[0].files


def test_published_url_follows_hf_endpoint(saved, hub, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example.org")
    assert main(["publish", str(saved), "me/x"]) == 0
    out = capsys.readouterr().out
    assert "https://hub.example.org/me/x" in out and "huggingface.co" not in out, out
    assert hub[0].files  # the upload itself went through the stand-in


@pytest.mark.parametrize("how", ["syntax-error", "auto-map-list", "config-list", "index-weight-map-list"])
def test_publish_of_a_damaged_code_or_json_file_is_one_line(saved, tmp_path, hub, capsys, how):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    if how == "syntax-error":
        (folder / "positions.py").write_text("def broken(:\n")
    elif how == "auto-map-list":
        config["auto_map"] = [config["auto_map"]["AutoConfig"]]
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "config-list":
        (folder / "config.json").write_text(json.dumps([config]))
    else:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    assert main(["publish", str(folder), "me/x"]) == 2
    one_line(capsys, "publish")
    assert not hub


# ============================================================================================= resources
def test_a_call_past_its_deadline_is_interrupted_and_its_thread_ends():
    import threading
    import time

    from switchhead.serving.requests import DeadlinePassed, run_with_deadline

    def forever():
        while True:
            pass

    start = time.monotonic()
    with pytest.raises(DeadlinePassed):
        run_with_deadline(forever, 0.3, "test-forever")
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 10
    while any(t.name == "test-forever" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "test-forever" for t in threading.enumerate())  # interrupted, not left spinning
    assert run_with_deadline(lambda: 7, 5, "test-quick") == 7
    with pytest.raises(KeyError):
        run_with_deadline(lambda: {}["x"], 5, "test-raises")


LOOPING_TEMPLATE = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def looping_server(tmp_path_factory):
    from transformers import AutoTokenizer

    from helpers.hub_folder import save_hub_folder
    from helpers.server import Server

    folder = tmp_path_factory.mktemp("looping") / "model"
    save_hub_folder(folder, "tiny-switchhead")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = LOOPING_TEMPLATE
    tokenizer.save_pretrained(folder)
    server = Server(str(folder), "--no-continuous-batching")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _post(server, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.integration
def test_a_chat_template_that_loops_forever_gets_an_error_and_the_server_stays_up(looping_server):
    import concurrent.futures

    chat = {"model": looping_server.checkpoint, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(_post, looping_server, "/v1/chat/completions", chat, 60)
        # meanwhile the server answers others
        assert looping_server.health() == 200
        status, answer = _post(looping_server, "/v1/completions", {"model": looping_server.checkpoint,
                                                                   "prompt": "Hello", "max_tokens": 2})
        assert status == 200, answer
        status, answer = stuck.result(timeout=60)
    assert status == 422 and "chat template" in json.dumps(answer), answer
    assert looping_server.health() == 200


@pytest.mark.integration
def test_sigterm_stops_the_server_promptly_with_a_render_stuck(looping_server):
    import signal
    import threading
    import time

    chat = {"model": looping_server.checkpoint, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    def stuck_request():
        try:
            _post(looping_server, "/v1/chat/completions", chat, 30)
        except OSError:  # the stopping server may close the connection without an answer
            pass

    threading.Thread(target=stuck_request, daemon=True).start()
    time.sleep(1.0)  # the render is running now
    started = time.monotonic()
    looping_server.process.send_signal(signal.SIGTERM)
    looping_server.process.wait(timeout=20)  # the server's own deadline is 6 s after SIGTERM
    assert time.monotonic() - started < 20
    assert looping_server.process.returncode == 0, looping_server.output()


# ============================================================================================= contract
@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory) -> Path:
    """A tiny model folder with its GPT-2 tokenizer and generation config, as `generate` and `serve` take it."""
    from helpers.hub_folder import save_hub_folder

    folder = tmp_path_factory.mktemp("tokenizer") / "model"
    save_hub_folder(folder, "tiny-switchhead")
    return folder


def edit_json(path: Path, **fields) -> None:
    value = json.loads(path.read_text()) if path.exists() else {}
    value.update(fields)
    path.write_text(json.dumps(value))


def _huge_hidden_size(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace(f'"hidden_size": {config["hidden_size"]}',
                                                     '"hidden_size": ' + "9" * 401))


DAMAGES = {
    "forced-eos-out-of-range": (lambda f: edit_json(f / "generation_config.json", forced_eos_token_id=10**6),
                                "forced_eos_token_id 1000000 is not a token"),
    "eos-not-an-id": (lambda f: edit_json(f / "generation_config.json", eos_token_id="</s>"), "not a token id"),
    "401-digit-hidden-size": (_huge_hidden_size, "401-digit"),
    "llama-architectures": (lambda f: edit_json(f / "config.json", architectures=["LlamaForCausalLM"]),
                            "LlamaForCausalLM"),
    "pad-token-number": (lambda f: edit_json(f / "tokenizer_config.json", pad_token=12345), "pad_token is 12345"),
    "pad-token-junk-object": (lambda f: edit_json(f / "tokenizer_config.json", pad_token={"junk": 1}), "pad_token"),
    "contrastive-search": (lambda f: edit_json(f / "generation_config.json", penalty_alpha=0.6, top_k=4),
                           "contrastive search"),
    "dola": (lambda f: edit_json(f / "generation_config.json", dola_layers="low"), "dola"),
    "group-beam-search": (lambda f: edit_json(f / "generation_config.json", num_beams=4, num_beam_groups=2,
                                              diversity_penalty=0.5), "group beam search"),
}


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_a_damaged_folder_is_one_line_before_loading(with_tokenizer, tmp_path, monkeypatch, capsys, command, how):
    import switchhead.serving

    damage, words = DAMAGES[how]
    folder = tmp_path / "model"
    shutil.copytree(with_tokenizer, folder)
    damage(folder)
    monkeypatch.setattr(switchhead.serving, "serve", lambda *a, **k: pytest.fail("the server must not start"))
    argv = ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"] if command == "generate" else \
        ["serve", str(folder), "--port", str(free_port())]
    assert main(argv) == 2
    line = one_line(capsys, command)
    assert words in line, line


@pytest.mark.parametrize("how", ["cut-short", "100000-deep", "401-digit-hidden-size", "llama-architectures"])
def test_card_of_a_damaged_config_is_one_line(saved, tmp_path, capsys, how):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    text = (folder / "config.json").read_text()
    if how == "cut-short":
        (folder / "config.json").write_text(text[: len(text) // 2])
    elif how == "100000-deep":
        (folder / "config.json").write_text("[" * 100000 + "]" * 100000)
    elif how == "401-digit-hidden-size":
        _huge_hidden_size(folder)
    else:
        edit_json(folder / "config.json", architectures=["LlamaForCausalLM"])
    assert main(["card", str(folder), "--output", "-"]) == 2
    one_line(capsys, "card")


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", "holds a list"),
    ("{\"hidden_size\": " + "9" * 401 + "}", "401-digit"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_flops_of_a_json_that_is_no_config_is_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["flops", str(path)]) == 2
    assert words in one_line(capsys, "flops")


def test_flops_set_of_a_401_digit_size_is_one_line(capsys):
    assert main(["flops", "tiny-switchhead", "--set", "hidden_size=" + "9" * 401]) == 2
    assert "401-digit" in one_line(capsys, "flops")


@pytest.mark.parametrize("content", [b"hello, this is text\n", b"", b"\x80\x02}q\x00."[:3]])
def test_convert_authors_to_hf_of_a_file_that_is_no_checkpoint_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "model.pth"
    path.write_bytes(content)
    assert main(["convert", "authors-to-hf", str(path), str(tmp_path / "out")]) == 2
    assert "not a readable torch checkpoint" in one_line(capsys, "convert")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [5, [1, 2], {"a": "b"}, True])
def test_train_data_whose_text_field_is_not_text_is_one_line(tmp_path, capsys, value):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": value}) + "\n" for _ in range(20)))
    assert main(["train", "--data", str(data), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]) == 2
    assert "not text" in one_line(capsys, "train")


def test_generate_with_a_safetensors_f4_tensor_is_one_line(saved, tmp_path, capsys):
    """A header declaring a 4-bit float dtype (safetensors' F4) for one of the weights."""
    import struct

    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    raw = (folder / "model.safetensors").read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    header[sorted(key for key in header if key != "__metadata__")[0]]["dtype"] = "F4"
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + size:])
    assert main(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    one_line(capsys, "generate")


@pytest.mark.integration
def test_sigterm_in_generates_first_seconds_ends_like_any_sigterm(with_tokenizer, tmp_path):
    """SIGTERM while the command still imports torch and Transformers: one line and 143, as later in the run."""
    import signal
    import subprocess
    import sys
    import time

    script = Path(sys.executable).with_name("switchhead")
    process = subprocess.Popen([str(script), "generate", str(with_tokenizer), "--prompt", "hi", "--max-new-tokens",
                                "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(1.5)  # the interpreter has started; the imports take longer than this
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, (process.returncode, err)
    assert err.splitlines() == ["switchhead generate: terminated"], err


def test_a_prompt_longer_than_the_model_reads_is_our_line_alone(with_tokenizer, capfd):
    """Transformers' "Token indices sequence length is longer..." came before our line naming the limit."""
    assert main(["generate", str(with_tokenizer), "--prompt", "word " * 2000, "--max-new-tokens", "2"]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and "max_position_embeddings" in err, err


@pytest.mark.parametrize("logger_name, message", [
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed. Skipping torchvision::nms"),
    ("transformers.tokenization_utils_base", "Token indices sequence length is longer than the specified maximum"),
])
def test_library_notices_before_our_line_are_dropped(logger_name, message):
    import logging

    from switchhead.cli import quiet_library_noise

    quiet_library_noise()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(message)
        logger.warning("another warning of the same library")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning of the same library"]


@pytest.mark.parametrize("change, words", [
    ({"learning_rte": 1e-3}, "does not know (learning_rte)"),
    ({"future_option": True}, "does not know (future_option)"),
    ({"learning_rate": "0.00025"}, "learning_rate = '0.00025' (str)"),
    ({"max_steps": 10.5}, "max_steps = '10.5' (float)"),
    ({"seed": True}, "seed = 'True' (bool)"),
    ({"model": [1, 2]}, "model = '[1, 2]' (list)"),
    ({"report_to": 3}, "report_to = '3' (int)"),
])
def test_a_trainer_state_with_unknown_or_mistyped_settings_is_refused_by_name(change, words):
    """The settings a resume continues with are exactly the saved ones: a misspelt or foreign key is not dropped
    silently, and a value of the wrong type is named (not reported as a changed setting, nor a traceback later)."""
    from switchhead.training.checkpoints import merge_resumed_config
    from switchhead.training.errors import TrainingError
    from switchhead.training.run_config import TrainingConfig

    def saved(config) -> dict:  # as read_checkpoint_state hands it over: JSON, adam_betas a tuple again
        stored = json.loads(json.dumps(config.to_dict()))
        stored["adam_betas"] = tuple(stored["adam_betas"])
        return stored

    config = TrainingConfig()
    stored = saved(config)
    stored.update(change)
    with pytest.raises(TrainingError) as caught:
        merge_resumed_config(config, stored)
    assert words in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert merge_resumed_config(config, saved(config)) == config
