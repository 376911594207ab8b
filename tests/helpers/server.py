"""A `switchhead serve` subprocess on a free loopback port, and what a served greedy request must equal."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import openai
import torch
from transformers import AutoTokenizer

from helpers.hub_folder import save_hub_folder
from helpers.network import free_port

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
MAX_TOKENS = 8


class ServerProcess:
    """A server subprocess on a free loopback port (`self.port`, known before `start`) with an `openai` client;
    `stop()` always ends it."""

    STARTUP_TIMEOUT = 90
    POLL_SECONDS = 0.2
    OUTPUT_CHARS = 4000

    def __init__(self, log_path: str, client_timeout: float = 60):
        self.port = free_port()
        self.log = open(log_path, "w+")
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=client_timeout)

    def start(self, command: list[str], env: dict | None = None, new_session: bool = False) -> None:
        """Run `command` offline, one thread; `env` entries set to None are removed from the environment."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={k: v for k, v in env.items() if v is not None},
                                        start_new_session=new_session)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(self.POLL_SECONDS)
        raise AssertionError(f"server not ready after {self.STARTUP_TIMEOUT} s:\n{self.output()}")

    def health(self) -> int:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
            return response.status

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-self.OUTPUT_CHARS:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class Server(ServerProcess):
    """`switchhead serve CHECKPOINT --port P` in a subprocess; `stop()` always ends it."""

    LAUNCHER = "import sys; from switchhead.cli import main; sys.exit(main())"

    def __init__(self, checkpoint: str, *flags: str, log_dir: str | None = None, env: dict | None = None):
        self.checkpoint = checkpoint
        super().__init__(os.path.join(log_dir or checkpoint, "server.log"))
        self.start([sys.executable, "-c", self.LAUNCHER, "serve", checkpoint, "--port", str(self.port), *flags], env)


def make_checkpoint(path, preset: str):
    model = save_hub_folder(path, preset)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return model, tokenizer


def expected_text(model, tokenizer, input_ids: list[int], max_new_tokens: int = MAX_TOKENS) -> str:
    with torch.no_grad():
        output = model.generate(torch.tensor([input_ids]), attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, len(input_ids):], skip_special_tokens=True)
