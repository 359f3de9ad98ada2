"""Generation through OpenAI-compatible completions endpoints (`vllm serve`, a cluster, any server).

`Endpoint(["http://host:8000", ...])` sends one `/v1/completions` request per problem (its `n`
samples, its own seed) and keeps at most `max_concurrency` requests in flight over all URLs, each
new request going to the URL with the fewest in flight: several `vllm serve` replicas behind the
list are data parallelism without a scheduler of ours. Connection errors, timeouts and 5xx/429
answers are retried with exponential backoff (on the least busy URL); any other error answer is a
UserError carrying the server's message.

When the server is vLLM (it answers `/version`), requests also carry vLLM's own fields: the stop
token ids, `return_token_ids` (the harness decodes the tokens with the checkpoint's tokenizer, as
for the in-process backends, and counts them exactly) and the neutral values of the sampling
knobs a checkpoint's generation_config could otherwise set server-side (top_k, min_p,
repetition_penalty). Other servers get the plain OpenAI fields and are read from `text`/`usage`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator, Sequence

from melt_eval.errors import UserError

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# a server's facts (/models, /version) come at once: one that takes longer is not the server --base-url meant,
# where a generation may rightly take hours
FACTS_TIMEOUT_S = 30.0
NOT_OPENAI = "is --base-url an OpenAI-compatible server (melt-eval serve, vllm serve)?"


@dataclass
class Completion:
    """One request's samples: token ids (vLLM servers; else None), texts, generated tokens, finish reasons."""

    token_ids: list[list[int]] | None
    texts: list[str]
    num_tokens: int
    finish_reasons: list[str]


def parse_base_urls(spec: str | Sequence[str]) -> list[str]:
    """'URL[,URL...]' -> normalised URLs ending in the API root (`.../v1`)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    urls = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if not item.startswith(("http://", "https://")):
            raise UserError(f"--base-url {item!r} is not an http(s) URL; pass e.g. http://localhost:8000/v1")
        item = item.rstrip("/")
        urls.append(item if item.endswith("/v1") else item + "/v1")
    if not urls:
        raise UserError("--backend endpoint needs --base-url URL[,URL...] (the OpenAI-compatible server(s))")
    return urls


class Endpoint:
    def __init__(self, base_urls: str | Sequence[str], *, max_concurrency: int = 64, retries: int = 6,
                 backoff_s: float = 1.0, timeout_s: float = 4 * 3600, api_key: str | None = None,
                 facts_timeout_s: float = FACTS_TIMEOUT_S) -> None:
        import httpx

        if max_concurrency < 1:
            raise UserError(f"--max-concurrency must be at least 1, got {max_concurrency}")
        self.base_urls = parse_base_urls(base_urls)
        self.max_concurrency, self.retries, self.backoff_s = max_concurrency, retries, backoff_s
        self.facts_timeout_s = facts_timeout_s
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # long generations (32K tokens) take many minutes: only connecting is held to a short limit
        timeout = httpx.Timeout(timeout_s, connect=30.0)
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._client = httpx.Client(timeout=timeout, limits=limits, headers=headers)
        self._in_flight = {url: 0 for url in self.base_urls}
        self._picks = 0  # rotates ties between equally busy URLs
        self._lock = threading.Lock()
        self.served_model: str | None = None
        self.vllm_version: str | None = None
        self.max_model_len: int | None = None
        self.retried = 0  # requests sent again after a transient failure (reported in results)

    # ------------------------------------------------------------------ server facts
    def info(self) -> dict:
        """Ask every URL what it serves; they must all serve the same model. Cached on the object."""
        models, versions = {}, {}
        for url in self.base_urls:
            body = self._request("GET", url, "/models", timeout_s=self.facts_timeout_s)
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
                raise UserError(f"{url}/models answered no list of models with ids; {NOT_OPENAI}")
            if len(data) != 1:
                ids = [m.get("id") for m in data]
                raise UserError(f"{url} serves {len(data)} models {ids}; point --base-url at a server of one model")
            models[url] = data[0]
            versions[url] = self._vllm_version(url)
        ids = {m["id"] for m in models.values()}
        if len(ids) != 1:
            raise UserError(f"the --base-url servers serve different models ({', '.join(sorted(ids))}); "
                            "list replicas of one model only")
        first = models[self.base_urls[0]]
        self.served_model = first["id"]
        self.max_model_len = first.get("max_model_len")
        found = {v for v in versions.values() if v}
        self.vllm_version = found.pop() if len(found) == 1 else (", ".join(sorted(found)) or None)
        return {"base_urls": self.base_urls, "served_model": self.served_model, "served_root": first.get("root"),
                "vllm_version": self.vllm_version, "max_model_len": self.max_model_len}

    def _vllm_version(self, url: str) -> str | None:
        """vLLM's `/version` (at the server root, beside /v1); None for servers that are not vLLM."""
        import httpx

        try:
            resp = self._client.get(url[: -len("/v1")] + "/version", timeout=self.facts_timeout_s)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return str(resp.json()["version"])
        except (ValueError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------------ requests
    def complete(self, prompt_ids: Sequence[int], *, n: int, temperature: float, top_p: float, max_tokens: int,
                 seed: int | None, stop_token_ids: Sequence[int] = (), extra: dict | None = None) -> Completion:
        """`n` samples of one prompt (token ids) in one request; `extra`: more request fields (e.g. ignore_eos)."""
        if self.served_model is None:
            self.info()
        # vLLM refuses n > 1 at temperature 0; greedy samples are all the same one, so ask once
        repeat = n if temperature == 0 and n > 1 else 1
        body = {"model": self.served_model, "prompt": list(prompt_ids), "n": n // repeat, "temperature": temperature,
                "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
        if self.vllm_version:
            body.update(stop_token_ids=list(stop_token_ids), return_token_ids=True, skip_special_tokens=True,
                        top_k=0, min_p=0.0, repetition_penalty=1.0)
        body.update(extra or {})
        answer = self._request("POST", None, "/completions", body)
        try:
            token_ids, texts, num_tokens, finish = _read_choices(answer, body["n"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # what a malformed answer raises in the read
            raise UserError(f"the server's /completions answer is not an OpenAI completion of {body['n']} sample(s) "
                            f"({type(exc).__name__}: {str(exc)[:200]}); {NOT_OPENAI}") from None
        if repeat > 1:  # every sample counts its tokens, as when the engine makes them
            texts, finish, num_tokens = texts * repeat, finish * repeat, num_tokens * repeat
            token_ids = token_ids * repeat if token_ids is not None else None
        return Completion(token_ids, texts, num_tokens, finish)

    def complete_many(self, requests: Sequence[dict]) -> Iterator[tuple[int, Completion]]:
        """(position, Completion) for each request (kwargs of `complete`), as they finish; at most
        `max_concurrency` in flight. After a failed request nothing new is sent, the requests in
        flight are still waited for and yielded (their samples are kept), then the error is raised."""
        if not requests:
            return
        if self.served_model is None:
            self.info()
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests)), thread_name_prefix="endpoint")
        queue = iter(enumerate(requests))
        pending: dict = {}
        error: BaseException | None = None
        finished = False

        def submit_next() -> None:
            nxt = next(queue, None)
            if nxt is not None:
                pending[pool.submit(self.complete, **nxt[1])] = nxt[0]

        try:
            for _ in range(self.max_concurrency):
                submit_next()
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    pos = pending.pop(fut)
                    if fut.exception() is not None:
                        error = error or fut.exception()
                        continue
                    if error is None:
                        submit_next()
                    yield pos, fut.result()
            finished = True
        finally:
            if not finished and error is None:  # interrupted (Ctrl-C, caller stopped): abandon what is in flight
                self._client.close()
            pool.shutdown(wait=True, cancel_futures=True)
        if error is not None:
            raise error

    def _pick(self, avoid: str | None = None) -> str:
        with self._lock:
            candidates = [u for u in self.base_urls if u != avoid] or self.base_urls
            # the least busy URL; ties taken in turn, or requests sent one at a time (or whenever every
            # replica is idle) would all go to the first URL
            n, turn = len(self.base_urls), self._picks
            url = min(candidates, key=lambda u: (self._in_flight[u], (self.base_urls.index(u) - turn) % n))
            self._picks += 1
            self._in_flight[url] += 1
            return url

    def _request(self, method: str, url: str | None, path: str, body: dict | None = None,
                 timeout_s: float | None = None) -> dict:
        """One call with retries; `url` None picks the least busy URL (and another one on a retry). With
        `timeout_s` (a server's facts), an answer that does not come in time is an error at once."""
        import httpx

        last_error, tried = "", None
        for attempt in range(self.retries + 1):
            target = url or self._pick(avoid=tried)
            try:
                resp = self._client.request(method, target + path, json=body,
                                            **({} if timeout_s is None else {"timeout": timeout_s}))
            except httpx.ReadTimeout as exc:
                if timeout_s is not None:  # connected, then silent: asking again waits as long again
                    raise UserError(f"{target}{path} did not answer in {timeout_s:g} s; {NOT_OPENAI}") from None
                last_error = f"{type(exc).__name__}: {exc}"
            except httpx.TransportError as exc:  # refused, reset, timed out
                last_error = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 300:
                    try:
                        return resp.json()
                    except ValueError:
                        raise UserError(f"{target}{path} answered {resp.status_code} with no JSON "
                                        f"({_server_message(resp)}); {NOT_OPENAI}") from None
                if resp.status_code not in RETRY_STATUS:
                    raise UserError(f"{target}{path} answered {resp.status_code}: {_server_message(resp)}")
                last_error = f"HTTP {resp.status_code}: {_server_message(resp)}"
            finally:
                if url is None:
                    with self._lock:
                        self._in_flight[target] -= 1
            tried = target
            if attempt < self.retries:
                with self._lock:
                    self.retried += 1
                time.sleep(min(60.0, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2))
        raise UserError(f"{target}{path} failed {self.retries + 1} times ({last_error}); check the server, then run the "
                        "same command again: finished problems are kept")

    def close(self) -> None:
        self._client.close()


def _read_choices(answer: dict, n: int) -> tuple[list[list[int]] | None, list[str], int, list[str]]:
    """(token ids or None, texts, generated tokens, finish reasons) of an answer that must hold `n` choices."""
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):  # a server that ignores n: its problems would have fewer samples
        raise ValueError(f"choices {[c['index'] for c in choices][:8]} for n={n}")
    token_ids = [list(map(int, c["token_ids"])) for c in choices] if all(c.get("token_ids") is not None
                                                                         for c in choices) else None
    num_tokens = sum(len(t) for t in token_ids) if token_ids is not None else int(answer["usage"]["completion_tokens"])
    texts = [c["text"] for c in choices]
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("a choice's text is not a string")
    return token_ids, texts, num_tokens, [c.get("finish_reason") or "stop" for c in choices]


def _server_message(resp) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip().splitlines()[0][:300] if resp.text.strip() else "(empty answer)"
    err = body.get("error", body) if isinstance(body, dict) else body
    msg = err.get("message", err) if isinstance(err, dict) else err
    return " ".join(str(msg).split())[:300]
