"""The harness's LightevalModel: LightEval's Pipeline asks it for completions, a backend makes them.

Prompts are LightEval's: its PromptManager joins the task's instruction and query and applies the
model's chat template, as it does for its own local models (a tokenizer without a template gets
the plain-text form). The backends (`melt_eval.generation.backends`: native engine, vLLM, an
OpenAI-compatible endpoint, or replayed completions) turn those prompts (token ids) into `n`
sampled texts each; this model hands them each problem's seed (`problem_seed`).

Resumption lives here, below LightEval: every finished problem's completions are appended to
`completions.jsonl` (flushed and fsynced) as soon as they exist, and a re-run reads them back
instead of generating, so an interrupted run loses at most the batch in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Callable

from lighteval.models.abstract_model import LightevalModel, ModelConfig
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.requests import Doc

from melt_eval.errors import UserError
from melt_eval.files import check_regular_file, write_failed
from melt_eval.generation.backends import ReplayBackend
from melt_eval.generation.options import InferenceOptions


def problem_key(doc: Doc) -> str:
    """A stable id for a problem: its task, its position in the split and its prompt text."""
    index = (doc.specific or {}).get("index")
    return hashlib.sha256(f"{doc.task_name}\n{index}\n{doc.query}".encode()).hexdigest()[:16]


def problem_seed(seed: int, key: str) -> int:
    # a problem's samples depend on the run seed and the problem alone, never on its batch
    return (seed * 1_000_003 + int(key, 16)) % (2**62)


class CompletionStore:
    """Append-only JSONL of finished problems: {"key", "completions", "tokens"} per line. Beside it,
    `segments.jsonl` records, with each stored problem, what the run segment that stored it had spent so far
    ({"segment": id, "wall_s", "peak_cache_bytes"}), so that a run resumed after an interruption reports the
    time and peak cache of all its segments together (completions.jsonl stays byte-identical to an
    uninterrupted run's).

    `peak` returns the backend's peak cache so far in this segment (None: unknown); `cache` the analytic twin of
    that peak and its rows ({"analytic_cache_bytes", "cache_rows"}; {} where the backend has none), recorded with
    it so that a resumed run reports the figures of the segment that reached the peak.

    `check_belongs` refuses, naming the line, one whose key is no problem of the run and one that follows a
    finished line of its problem with other content: which of the two the run should keep is not the harness's
    to guess. (A line with fewer samples than the run makes is generated again, and the new line follows it.)"""

    SEGMENTS = "segments.jsonl"

    def __init__(self, path: Path, peak: Callable[[], int | None] = lambda: None,
                 cache: Callable[[], dict] = dict) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        self.history: dict[str, list[tuple[int, dict]]] = {}  # key -> its lines in completions.jsonl (number, row)
        self.segment, self.started, self.peak, self.cache = uuid.uuid4().hex[:12], time.perf_counter(), peak, cache
        self.segments: dict[str | None, dict] = {}  # segment id -> {"wall_s", "peak_cache_bytes"}
        self.segments_path = path.with_name(self.SEGMENTS)
        if not path.exists():
            return
        if path.is_dir():
            raise UserError(f"{path} is a directory, where the run keeps its finished problems; move it away")
        check_regular_file(path, "the run's completions.jsonl", max_bytes=None)  # a FIFO would block
        data = path.read_bytes()
        good = 0  # bytes of whole, readable lines
        lines = data.splitlines(keepends=True)
        for number, raw in enumerate(lines, start=1):
            if not raw.endswith(b"\n"):
                break  # the last line, cut by a kill
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                if number == len(lines):
                    break  # a last line whose write was cut
                row = None
            if not self.valid_row(row):
                # a damaged line in the middle is not something a kill leaves: say which, lose nothing
                raise UserError(
                    f"{path}:{number} is not a finished problem (a JSON object with a string \"key\", a list of "
                    "string \"completions\" and an integer \"tokens\"); delete that line (its problem is generated "
                    "again) and re-run: the other finished problems are kept"
                )
            self.done[row["key"]] = row
            self.history.setdefault(row["key"], []).append((number, row))
            good += len(raw)
        if good < len(data):
            # a line cut by a kill: drop it (and anything after), so that new lines follow whole ones
            with open(path, "r+b") as f:
                f.truncate(good)
        self._read_segments()

    def _read_segments(self) -> None:
        """Earlier segments' records; bookkeeping only, so an unreadable line (cut by a kill) is skipped.
        Problems stored by a version that kept no records count as one earlier segment of unknown cost."""
        if self.segments_path.exists() or self.segments_path.is_symlink():
            check_regular_file(self.segments_path, "the run's segments.jsonl", max_bytes=None)
            for raw in self.segments_path.read_bytes().splitlines():
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                    continue
                if isinstance(row, dict) and isinstance(row.get("segment"), str):
                    self._count(row)
        if self.done and not self.segments:
            self.segments[None] = {"wall_s": 0.0, "peak_cache_bytes": None, "cache": {}}

    def check_belongs(self, keys: set[str], samples: int) -> None:
        """Every stored problem is one of this run's (`keys`), and its lines are the run's own history: lines
        with another sample count than `samples` (generated again), then at most one finished line (repeated
        identically, if at all). Anything else is a one-line UserError naming the line: a line from elsewhere
        would add its tokens, one after a finished line would replace it."""
        for key, lines in self.history.items():
            if key not in keys:
                raise UserError(f"{self.path}:{lines[0][0]} holds problem {key}, which is not one of this run's "
                                "problems; delete that line (it came from another run or was added by hand) and re-run")
            finished = None
            for number, row in lines:
                if finished is not None and row != finished[1]:
                    raise UserError(f"{self.path}:{number} holds problem {key} again, with other completions than "
                                    f"line {finished[0]}; delete the line that is not the run's own (or both: the "
                                    "problem is generated again) and re-run")
                if finished is None and len(row["completions"]) == samples:
                    finished = (number, row)

    @staticmethod
    def valid_row(row) -> bool:
        return (isinstance(row, dict) and isinstance(row.get("key"), str) and isinstance(row.get("completions"), list)
                and all(isinstance(c, str) for c in row["completions"])
                and isinstance(row.get("tokens", 0), int) and not isinstance(row.get("tokens", 0), bool))

    def _count(self, row: dict) -> None:
        wall, peak, cache = row.get("wall_s"), row.get("peak_cache_bytes"), row.get("cache")
        totals = self.segments.setdefault(row["segment"], {"wall_s": 0.0, "peak_cache_bytes": None, "cache": {}})
        if isinstance(wall, (int, float)) and not isinstance(wall, bool) and wall >= 0:
            totals["wall_s"] = max(totals["wall_s"], float(wall))
        if isinstance(peak, int) and not isinstance(peak, bool) and peak > 0:
            totals["peak_cache_bytes"] = max(totals["peak_cache_bytes"] or 0, peak)
            if isinstance(cache, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in cache.values()):
                totals["cache"] = {k: cache[k] for k in ("analytic_cache_bytes", "cache_rows") if k in cache}

    def totals(self, peak_now: int | None, cache_now: dict | None = None) -> dict:
        """wall_time_s (summed), peak_cache_bytes (the maximum) and segments over every segment of the run,
        this one (running since `started`, its peak `peak_now`, its cache figures `cache_now`) included, and
        the analytic figures of the peak (`analytic_cache_bytes`, `cache_rows`: the last segment that reached
        it, as one uninterrupted run keeps its last wave that reached its peak). An earlier segment's time
        counts up to its last stored problem: what it did after that was lost with it and is done again."""
        earlier = {s: t for s, t in self.segments.items() if s != self.segment}
        now = {"peak_cache_bytes": peak_now or None, "cache": dict(cache_now or {})}
        ordered = [*earlier.values(), now]
        peaks = [t["peak_cache_bytes"] for t in ordered if t["peak_cache_bytes"]]
        peak = max(peaks) if peaks else None
        cache = next((t["cache"] for t in reversed(ordered) if peak and t["peak_cache_bytes"] == peak), {})
        return {"wall_time_s": round(sum(t["wall_s"] for t in earlier.values()) + time.perf_counter() - self.started, 3),
                "peak_cache_bytes": peak, "segments": len(earlier) + 1, **cache}

    def add(self, key: str, completions: list[str], tokens: int, loop_counts: list[int] | None = None) -> None:
        row = {"key": key, "completions": completions, "tokens": tokens}
        if loop_counts is not None:  # --exit: its generated tokens that ran 1, 2, ..., T loops
            row["loop_counts"] = loop_counts
        record = {"segment": self.segment, "wall_s": round(time.perf_counter() - self.started, 3),
                  "peak_cache_bytes": self.peak()}
        if cache := self.cache():
            record["cache"] = cache
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._append(self.path, row)
        self.done[key] = row
        self._append(self.segments_path, record)
        self._count(record)

    def _append(self, path: Path, row: dict) -> None:
        """One whole line, fsynced; a full disk cuts the partial line and is one UserError."""
        data = (json.dumps(row) + "\n").encode("utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            size = os.fstat(fd).st_size
            view = memoryview(data)
            while view:  # unbuffered: a failed write leaves nothing queued to fail again at close
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass  # a cut last line is dropped when the run resumes
            raise write_failed(exc, path, f"the {len(self.done)} problems finished before are kept "
                               "(the run resumes from them)") from None
        finally:
            os.close(fd)


class _NoSampleCache:
    """LightEval's per-model sample cache, switched off: the harness resumes from its own store."""

    def _init_registry(self, registry) -> None:
        pass


class HarnessModel(LightevalModel):
    """What LightEval's Pipeline talks to: chat-formats each Doc and fetches or makes its samples."""

    def __init__(self, name: str, tokenizer, backend, options: InferenceOptions, store: CompletionStore,
                 *, system_prompt: str | None = None, on_batch: Callable[[int, int], None] | None = None,
                 counted: int = 0) -> None:
        """`options`: the run's, with the task's sample count and length resolved (`for_task`); `counted`: the
        stored problems the progress display already started from (a resumed run's)."""
        self.config = ModelConfig(model_name=name)
        self._tokenizer = tokenizer
        self.backend, self.options, self.store = backend, options, store
        self.system_prompt = system_prompt
        self.on_batch = on_batch  # (problems finished, tokens generated) -> None, for progress bars
        self.counted = counted
        self._cache = _NoSampleCache()
        self.generated_tokens = 0
        self.eos_ids = self._eos_ids(tokenizer)

    # LightevalModel interface -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def add_special_tokens(self) -> bool:
        return False

    @property
    def max_length(self) -> int:
        return getattr(self._tokenizer, "model_max_length", 1 << 20)

    @property
    def disable_tqdm(self) -> bool:
        return True

    def greedy_until(self, docs: list[Doc]) -> list[ModelResponse]:
        keys = [problem_key(d) for d in docs]
        # a problem is done when all its samples are: a line with fewer (or more) is generated again
        sampling = self.options.sampling
        todo = [i for i, k in enumerate(keys)
                if k not in self.store.done or len(self.store.done[k]["completions"]) != sampling.samples]
        if todo and isinstance(self.backend, ReplayBackend):
            raise UserError(f"the completions file has no entry for {len(todo)} problem(s) of the task (first: index {todo[0]})")
        if self.on_batch and len(docs) - len(todo) > self.counted:
            self.on_batch(len(docs) - len(todo) - self.counted, 0)
        self.counted = 0
        step = self.backend.problems_per_batch(sampling.samples)
        for start in range(0, len(todo), step):
            idx = todo[start : start + step]
            prompts = [self.encode(docs[i]) for i in idx]
            seeds = [problem_seed(sampling.seed, keys[i]) for i in idx]
            if hasattr(self.backend, "generate_each"):  # store each problem the moment it is done
                for pos, texts, tokens in self.backend.generate_each(prompts, seeds, sampling, self.eos_ids):
                    self.store.add(keys[idx[pos]], texts, tokens)
                    self.generated_tokens += tokens
                    if self.on_batch:
                        self.on_batch(1, tokens)
                continue
            batch = self.backend.generate(prompts, seeds, sampling, self.eos_ids)
            loop_counts = batch.loop_counts or [None] * len(idx)
            for i, texts, tokens, counts in zip(idx, batch.texts, batch.tokens, loop_counts):
                self.store.add(keys[i], texts, tokens, counts)
                self.generated_tokens += tokens
            if self.on_batch:
                self.on_batch(len(idx), sum(batch.tokens))
        # input: the prompt text, as LightEval's own models report it (its details files keep it)
        return [ModelResponse(input=self.prompt_text(d), text=list(self.store.done[k]["completions"])) for d, k in zip(docs, keys)]

    def loglikelihood(self, docs):
        raise NotImplementedError("melt-eval tasks are generative")

    def loglikelihood_rolling(self, docs):
        raise NotImplementedError("melt-eval tasks are generative")

    def cleanup(self) -> None:
        pass

    # helpers --------------------------------------------------------------------------------------
    def prompt_text(self, doc: Doc) -> str:
        """The prompt exactly as LightEval builds it for a local model (its PromptManager: system prompt,
        the task's instruction, the model's chat template); plain text where the tokenizer has no template."""
        from lighteval.tasks.prompt_manager import PromptManager

        chat = bool(getattr(self._tokenizer, "chat_template", None))
        return PromptManager(use_chat_template=chat, tokenizer=self._tokenizer, system_prompt=self.system_prompt).prepare_prompt(doc)

    def encode(self, doc: Doc) -> list[int]:
        """`prompt_text` as token ids."""
        chat = bool(getattr(self._tokenizer, "chat_template", None))
        return self._tokenizer.encode(self.prompt_text(doc), add_special_tokens=not chat)

    @staticmethod
    def _eos_ids(tokenizer) -> list[int]:
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return sorted(ids)
