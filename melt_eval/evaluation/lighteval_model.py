"""The harness's LightevalModel: LightEval's Pipeline asks it for completions, a backend makes them.

Prompts are LightEval's: its PromptManager joins the task's instruction and query and applies the
model's chat template, as it does for its own local models (a tokenizer without a template gets
the plain-text form). Backends turn those prompts (token ids) into `n` sampled texts each:

* `NativeBackend`: LoopLM and MELT through the native engine (`melt_eval.generation`), any other
  transformers causal LM through its own `generate`;
* `VllmBackend`: `melt_eval.generation.vllm_backend.VllmGenerator`;
* `EndpointBackend`: OpenAI-compatible completions servers (`melt_eval.generation.endpoint`), each
  problem stored as soon as its request returns;
* `ReplayBackend`: completions read from a file (`melt-eval score`), nothing generated.

Resumption lives here, below LightEval: every finished problem's completions are appended to
`completions.jsonl` (flushed and fsynced) as soon as they exist, and a re-run reads them back
instead of generating, so an interrupted run loses at most the batch in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from lighteval.models.abstract_model import LightevalModel, ModelConfig
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.requests import Doc

from melt_eval.errors import UserError
from melt_eval.generation.options import InferenceOptions, Sampling


def problem_key(doc: Doc) -> str:
    """A stable id for a problem: its task, its position in the split and its prompt text."""
    index = (doc.specific or {}).get("index")
    return hashlib.sha256(f"{doc.task_name}\n{index}\n{doc.query}".encode()).hexdigest()[:16]


def problem_seed(seed: int, key: str) -> int:
    # a problem's samples depend on the run seed and the problem alone, never on its batch
    return (seed * 1_000_003 + int(key, 16)) % (2**62)


class CompletionStore:
    """Append-only JSONL of finished problems: {"key", "completions", "tokens"} per line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        if not path.exists():
            return
        if path.is_dir():
            raise UserError(f"{path} is a directory, where the run keeps its finished problems; move it away")
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
            good += len(raw)
        if good < len(data):
            # a line cut by a kill: drop it (and anything after), so that new lines follow whole ones
            with open(path, "r+b") as f:
                f.truncate(good)

    @staticmethod
    def valid_row(row) -> bool:
        return (isinstance(row, dict) and isinstance(row.get("key"), str) and isinstance(row.get("completions"), list)
                and all(isinstance(c, str) for c in row["completions"])
                and isinstance(row.get("tokens", 0), int) and not isinstance(row.get("tokens", 0), bool))

    def add(self, key: str, completions: list[str], tokens: int) -> None:
        row = {"key": key, "completions": completions, "tokens": tokens}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[key] = row


@dataclass
class Batch:
    texts: list[list[str]]  # [prompt][sample]
    tokens: list[int]  # generated tokens per prompt, all samples
    peak_cache_bytes: int | None = None


class NativeBackend:
    """The native engine for LoopLM/MELT; transformers' generate for any other causal LM."""

    def __init__(self, model, tokenizer, options: InferenceOptions, *, batch_rows=64, max_cache_bytes=None,
                 allow_beyond_max_positions=False) -> None:
        from melt_eval.modeling import LoopLMForCausalLM

        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.looped = isinstance(model, LoopLMForCausalLM)  # the runner refused loop options for any other model
        self.batch_rows = batch_rows
        self.max_cache_bytes, self.allow_beyond_max_positions = max_cache_bytes, allow_beyond_max_positions
        self.peak_cache_bytes = 0

    def problems_per_batch(self, samples: int) -> int:
        return max(1, self.batch_rows // samples)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], seeds: list[int], s: Sampling, eos: list[int]) -> Batch:
        if self.looped:
            from melt_eval.generation import generate

            res = generate(
                self.model, prompts, self.options, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                max_new_tokens=s.max_new_tokens, seed=seeds, eos_token_id=eos,
                max_cache_bytes=self.max_cache_bytes, allow_beyond_max_positions=self.allow_beyond_max_positions,
            )
            self.peak_cache_bytes = max(self.peak_cache_bytes, res.peak_cache_bytes)
            texts = [[self._decode(seq) for seq in per] for per in res.sequences]
            tokens = [sum(len(seq) for seq in per) for per in res.sequences]
            return Batch(texts, tokens, res.peak_cache_bytes)
        from melt_eval.generation.engine import plan_waves

        texts, tokens = [], []
        for prompt, seed in zip(prompts, seeds):  # HF generate: one prompt (n samples) at a time
            plan_waves(self.model, prompt_tokens=len(prompt), max_new_tokens=s.max_new_tokens, rows=s.samples,
                       allow_beyond_max_positions=self.allow_beyond_max_positions)  # refuses positions it cannot hold
            torch.manual_seed(seed)
            ids = torch.tensor([prompt], device=self.model.device)
            kwargs = dict(do_sample=s.temperature > 0, max_new_tokens=s.max_new_tokens, num_return_sequences=s.samples,
                          eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos[0])
            if s.temperature > 0:
                kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                          **kwargs)
            self.peak_cache_bytes = max(self.peak_cache_bytes, _cache_bytes(out.past_key_values))
            seqs = [self._trim(row[len(prompt):].tolist(), eos) for row in out.sequences]
            texts.append([self._decode(q) for q in seqs])
            tokens.append(sum(len(q) for q in seqs))
        return Batch(texts, tokens)

    @staticmethod
    def _trim(seq: list[int], eos: list[int]) -> list[int]:
        for i, t in enumerate(seq):
            if t in eos:
                return seq[: i + 1]
        return seq

    def _decode(self, seq: list[int]) -> str:
        return self.tokenizer.decode(seq, skip_special_tokens=True)


def _cache_bytes(cache) -> int:
    """Bytes held by a transformers KV cache at the end of generation (its largest size)."""
    tensors = []
    for layer in getattr(cache, "layers", None) or []:
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


class VllmBackend:
    """vLLM through the harness's generator (the vLLM plugin serves LoopLM and MELT)."""

    def __init__(self, generator_cls, model_path: str, tokenizer, options: InferenceOptions, **engine) -> None:
        self.tokenizer = tokenizer
        self.engine = engine  # dtype, max_model_len, gpu_memory_utilization, kv_cache_bytes, tensor_parallel_size
        self._make = lambda: generator_cls(model_path, options, **engine)
        self.generator = None
        self.peak_cache_bytes = 0

    def identity_settings(self) -> dict:
        return {"dtype": self.engine.get("dtype") or "auto"}  # the rest changes memory and speed, not the samples

    def describe(self) -> dict:
        return {"engine": self.generator.engine_info()} if self.generator is not None else {}

    def start(self) -> None:
        if self.generator is None:
            self.generator = self._make()

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
            self.generator = None

    def problems_per_batch(self, samples: int) -> int:
        return 10_000  # vLLM schedules on its own

    def generate(self, prompts, seeds, s: Sampling, eos) -> Batch:
        self.start()
        res = self.generator.generate(prompts, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                                      max_new_tokens=s.max_new_tokens, seed=seeds, stop_token_ids=eos)
        self.peak_cache_bytes = max(self.peak_cache_bytes, res.peak_cache_bytes or 0)
        texts = [[self.tokenizer.decode(q, skip_special_tokens=True) for q in per] for per in res.sequences]
        return Batch(texts, [sum(len(q) for q in per) for per in res.sequences], res.peak_cache_bytes)


class EndpointBackend:
    """Any OpenAI-compatible completions server(s): one request per problem, bounded concurrency."""

    peak_cache_bytes = None  # the server's memory is not ours to read

    def __init__(self, base_urls, tokenizer, *, max_concurrency: int = 64) -> None:
        from melt_eval.generation.endpoint import Endpoint

        self.tokenizer = tokenizer
        self.endpoint = Endpoint(base_urls, max_concurrency=max_concurrency)
        self.server: dict | None = None

    def start(self) -> None:
        if self.server is None:
            self.server = self.endpoint.info()

    def identity_settings(self) -> dict:
        self.start()
        return {"served_model": self.server["served_model"]}

    def describe(self) -> dict:
        return {"endpoint": {**self.server, "max_concurrency": self.endpoint.max_concurrency,
                             "retried_requests": self.endpoint.retried}}

    def close(self) -> None:
        self.endpoint.close()

    def problems_per_batch(self, samples: int) -> int:
        return 10_000  # requests stream: each finished problem is stored at once

    def generate_each(self, prompts, seeds, s: Sampling, eos):
        """(position, texts, tokens) per problem, in the order they finish."""
        self.start()
        requests = [dict(prompt_ids=p, n=s.samples, temperature=s.temperature, top_p=s.top_p,
                         max_tokens=s.max_new_tokens, seed=seed, stop_token_ids=eos) for p, seed in zip(prompts, seeds)]
        for pos, c in self.endpoint.complete_many(requests):
            texts = c.texts if c.token_ids is None else [self.tokenizer.decode(q, skip_special_tokens=True) for q in c.token_ids]
            yield pos, texts, c.num_tokens

    def generate(self, prompts, seeds, s: Sampling, eos) -> Batch:
        texts, tokens = [None] * len(prompts), [0] * len(prompts)
        for pos, t, n in self.generate_each(prompts, seeds, s, eos):
            texts[pos], tokens[pos] = t, n
        return Batch(texts, tokens)


class ReplayBackend:
    """Completions from a file, looked up by the problem's key; used by `melt-eval score`."""

    peak_cache_bytes = None

    def problems_per_batch(self, samples: int) -> int:
        return 10_000

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, prompts, seeds, s, eos) -> Batch:  # pragma: no cover - never called
        raise AssertionError("replay runs read every problem from the store")


class _NoSampleCache:
    """LightEval's per-model sample cache, switched off: the harness resumes from its own store."""

    def _init_registry(self, registry) -> None:
        pass


class HarnessModel(LightevalModel):
    """What LightEval's Pipeline talks to: chat-formats each Doc and fetches or makes its samples."""

    def __init__(self, name: str, tokenizer, backend, options: InferenceOptions, store: CompletionStore,
                 *, system_prompt: str | None = None, on_batch: Callable[[int, int], None] | None = None) -> None:
        """`options`: the run's, with the task's sample count and length resolved (`for_task`)."""
        self.config = ModelConfig(model_name=name)
        self._tokenizer = tokenizer
        self.backend, self.options, self.store = backend, options, store
        self.system_prompt = system_prompt
        self.on_batch = on_batch  # (problems finished, tokens generated) -> None, for progress bars
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
        if self.on_batch:
            self.on_batch(len(docs) - len(todo), 0)
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
            for i, texts, tokens in zip(idx, batch.texts, batch.tokens):
                self.store.add(keys[i], texts, tokens)
                self.generated_tokens += tokens
            if self.on_batch:
                self.on_batch(len(idx), sum(batch.tokens))
        return [ModelResponse(input=d.query, text=list(self.store.done[k]["completions"])) for d, k in zip(docs, keys)]

    def loglikelihood(self, docs):
        raise NotImplementedError("melt-eval tasks are generative")

    def loglikelihood_rolling(self, docs):
        raise NotImplementedError("melt-eval tasks are generative")

    def cleanup(self) -> None:
        pass

    # helpers --------------------------------------------------------------------------------------
    def encode(self, doc: Doc) -> list[int]:
        """The prompt exactly as LightEval builds it for a local model (its PromptManager: system prompt,
        the task's instruction, the model's chat template); plain text where the tokenizer has no template."""
        from lighteval.tasks.prompt_manager import PromptManager

        chat = bool(getattr(self._tokenizer, "chat_template", None))
        text = PromptManager(use_chat_template=chat, tokenizer=self._tokenizer, system_prompt=self.system_prompt).prepare_prompt(doc)
        return self._tokenizer.encode(text, add_special_tokens=not chat)

    @staticmethod
    def _eos_ids(tokenizer) -> list[int]:
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return sorted(ids)
