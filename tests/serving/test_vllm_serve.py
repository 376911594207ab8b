"""`vllm serve FOLDER` over real HTTP through the `openai` client, and `switchhead serve FOLDER --engine vllm`.

The server runs in the vLLM environment (scripts/test.sh runs this file in .venv-vllm; skipped where vLLM is not
installed) as a subprocess on a free loopback port, always stopped at the end. The checkpoint is a tiny
SwitchHead with a GPT-2 tokenizer and a chat template; `vllm serve` gets no model flags (the plugin's entry point
picks `switchhead.vllm`), only a small engine for the test machine. /v1/completions and /v1/chat/completions,
streamed and not, must return the text of `generate()` in this process.
`switchhead serve --engine vllm` replaces itself by that same server (`python -m vllm.entrypoints.cli.main serve`,
the module behind the `vllm` script): its command line and its refusals (vLLM missing, options only Transformers'
server has) are checked without starting a second server, in any environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from switchhead.cli import main as cli_main

TEST_ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--max-num-seqs", "8"]
STARTUP_TIMEOUT = 420  # three processes import vLLM on a loaded 2-core machine
MAX_TOKENS = 8
PROMPTS = ["Hello world", "The quick brown fox jumps over", "A", "In 1905 Einstein published four papers on",
           "def main():", "Serving models is", "one two three four five six seven eight nine ten", "Why"]


class VllmServer:
    """A server subprocess (`command` gets `--port P` appended) on 127.0.0.1; `stop()` always ends it."""

    def __init__(self, command: list[str], log_path: str):
        from helpers.server import free_port

        self.port = free_port()
        self.log = open(log_path, "w+")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engine in its own process, as deployed
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=self.log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        import openai

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"server not ready after {STARTUP_TIMEOUT} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), SIGKILL after 30 s."""
        import signal

        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # children left behind by a crash
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


def _needs_vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test.sh runs this file in .venv-vllm")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    _needs_vllm()
    from helpers.server import make_checkpoint

    path = tmp_path_factory.mktemp("vllm-serve") / "tiny-switchhead"
    model, tokenizer = make_checkpoint(path, "tiny-switchhead")
    return str(path), model, tokenizer


def _expected(model, tokenizer, ids):
    from helpers.server import expected_text

    return expected_text(model, tokenizer, ids, MAX_TOKENS)


def _chat_ids(tokenizer, content):
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def _exercise(server: VllmServer, name: str, model, tokenizer) -> None:
    """Completions and chat, plain and streamed, 8 prompts at once: each equals generate()."""
    def complete(prompt, stream=False):
        args = dict(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        if not stream:
            return server.client.completions.create(**args).choices[0].text
        return "".join(chunk.choices[0].text for chunk in server.client.completions.create(stream=True, **args)
                       if chunk.choices)

    def chat(content, stream=False):
        args = dict(model=name, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
                    temperature=0)
        if not stream:
            return server.client.chat.completions.create(**args).choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in
                       server.client.chat.completions.create(stream=True, **args) if chunk.choices)

    assert [m.id for m in server.client.models.list().data] == [name]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in flight together: vLLM batches them
        texts = list(pool.map(complete, PROMPTS))
    for prompt, text in zip(PROMPTS, texts):
        assert text == _expected(model, tokenizer, tokenizer(prompt)["input_ids"]), prompt
    assert complete(PROMPTS[1], stream=True) == texts[1]
    for content in PROMPTS[:3]:
        want = _expected(model, tokenizer, _chat_ids(tokenizer, content))
        assert chat(content) == want
        assert chat(content, stream=True) == want


def test_vllm_serve_answers_completions_and_chat_like_generate(checkpoint, tmp_path):
    path, model, tokenizer = checkpoint
    vllm_script = os.path.join(os.path.dirname(sys.executable), "vllm")  # the console script a user runs
    command = [vllm_script, "serve", path, "--host", "127.0.0.1", *TEST_ENGINE]
    server = VllmServer(command, str(tmp_path / "vllm-serve.log"))
    try:
        server.wait_ready()
        _exercise(server, path, model, tokenizer)
    finally:
        server.stop()


# ------------------------------------------------------------------------------ refusals, in any environment
def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def config_folder(tmp_path):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(tmp_path)
    return str(tmp_path)


def _serve_error(capsys, *argv) -> str:
    assert cli_main(["serve", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("switchhead serve: error: "), lines
    return lines[0]


def test_engine_vllm_without_vllm_is_a_clear_error(config_folder, capsys, monkeypatch):
    import switchhead.cli.serve as serve_command

    monkeypatch.setattr(serve_command, "vllm_available", lambda: False)
    line = _serve_error(capsys, config_folder, "--engine", "vllm", "--port", str(_free_port()))
    assert "--engine vllm needs vLLM" in line and "scripts/vllm.sh" in line


@pytest.mark.parametrize("flags, named", [(["--cb-num-blocks", "8"], "--cb-num-blocks"),
                                          (["--no-continuous-batching"], "--no-continuous-batching"),
                                          (["--attn-implementation", "sdpa"], "--attn-implementation"),
                                          (["--device", "cuda"], "--device cuda"),
                                          (["--vllm-args", "--max-model-len '1024"], "--vllm-args")])
def test_engine_vllm_refuses_options_it_cannot_pass(config_folder, capsys, monkeypatch, flags, named):
    import switchhead.cli.serve as serve_command

    monkeypatch.setattr(serve_command, "vllm_available", lambda: True)
    monkeypatch.setattr(serve_command.os, "execve", lambda *args: pytest.fail("vllm serve must not start"))
    line = _serve_error(capsys, config_folder, "--engine", "vllm", "--port", str(_free_port()), *flags)
    assert named in line


def test_engine_vllm_command_line(config_folder, monkeypatch):
    import switchhead.cli.serve as serve_command

    started = []
    monkeypatch.setattr(serve_command, "vllm_available", lambda: True)
    monkeypatch.setattr(serve_command.os, "execve", lambda path, argv, env: started.append((argv, env)))
    port = str(_free_port())
    assert cli_main(["serve", config_folder, "--engine", "vllm", "--port", port, "--default-seed", "3",
                     "--vllm-args", "--max-model-len 64 --enforce-eager"]) == 0
    (argv, env), = started
    assert argv == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", config_folder, "--host", "127.0.0.1",
                    "--port", port, "--dtype", "auto", "--seed", "3", "--max-model-len", "64", "--enforce-eager"]
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
