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
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.server import ServerProcess, free_port
from switchhead.cli import main as cli_main

TEST_ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--max-num-seqs", "8"]
MAX_TOKENS = 8
PROMPTS = ["Hello world", "The quick brown fox jumps over", "A", "In 1905 Einstein published four papers on",
           "def main():", "Serving models is", "one two three four five six seven eight nine ten", "Why"]


class VllmServer(ServerProcess):
    """A vLLM server subprocess (`command` gets `--port P` appended) on 127.0.0.1, in its own process group;
    `stop()` always ends the group."""

    STARTUP_TIMEOUT = 420  # three processes import vLLM on a loaded 2-core machine
    POLL_SECONDS = 1
    OUTPUT_CHARS = 6000

    def __init__(self, command: list[str], log_path: str):
        super().__init__(log_path, client_timeout=120)
        self.start([*command, "--port", str(self.port)], new_session=True, env={
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": None})  # the server's engine in its own process, as deployed

    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, worker), SIGKILL after 30 s."""
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
    line = _serve_error(capsys, config_folder, "--engine", "vllm", "--port", str(free_port()))
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
    line = _serve_error(capsys, config_folder, "--engine", "vllm", "--port", str(free_port()), *flags)
    assert named in line


def test_engine_vllm_command_line(config_folder, monkeypatch):
    import switchhead.cli.serve as serve_command

    started = []
    monkeypatch.setattr(serve_command, "vllm_available", lambda: True)
    monkeypatch.setattr(serve_command.os, "execve", lambda path, argv, env: started.append((argv, env)))
    port = str(free_port())
    assert cli_main(["serve", config_folder, "--engine", "vllm", "--port", port, "--default-seed", "3",
                     "--vllm-args", "--max-model-len 64 --enforce-eager"]) == 0
    (argv, env), = started
    assert argv == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", config_folder, "--host", "127.0.0.1",
                    "--port", port, "--dtype", "auto", "--seed", "3", "--max-model-len", "64", "--enforce-eager"]
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
