"""Training data: sources mixed by weight, rendered with the model's chat template.

A recipe's `data` is a list of sources, each a mapping with `source` and `weight`:

    - {source: hub, path: nvidia/AceReason-1.1-SFT, split: train, weight: 0.5}   # datasets streaming
    - {source: local, path: data/train.jsonl, weight: 1.0}                        # .jsonl/.json/.parquet (file or glob)
    - {source: synthetic, n: 20000, num_steps: [1, 3], max_value: 9, target: answer}  # melt_eval.synthetic (form: digits too)

Examples become chats (`to_messages` knows the schemas of AceReason-1.1-SFT, OpenThoughts3,
"messages", "conversations", problem/solution, prompt/response), are tokenized with the
tokenizer's chat template, truncated to `seq_len`, and carry a loss mask that is True on
assistant tokens only (their content and end-of-turn token, not the template's prompt).

Order is a pure function of the recipe seed: the mixer draws a source per example from
its own RNG, and each source walks epochs of a seeded shuffle. `DataStream.state_dict()`
records how far each source and the mixer got, so `--resume` continues with exactly the
examples the interrupted run would have seen next. Every process reads the same global
stream and keeps every world_size-th example, so the state is the same on all of them.
"""

from __future__ import annotations

import glob
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from melt_eval.errors import UserError
from melt_eval import synthetic
from melt_eval.training.config import DATA_KEYS

SOURCE_KINDS = ("hub", "local", "synthetic")
_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


# --- examples -> chats -----------------------------------------------------------------------------


def to_messages(example: dict) -> list[dict] | None:
    """A chat [{role, content}] from one dataset row, or None for a schema we do not know."""
    if isinstance(example.get("messages"), list):
        return [{"role": m["role"], "content": m["content"]} for m in example["messages"]]
    if isinstance(example.get("conversations"), list):  # OpenThoughts3: {"from": "human"|"gpt", "value"}
        msgs = []
        for m in example["conversations"]:
            role = _ROLE.get(str(m.get("from", m.get("role"))).lower())
            if role is None:
                return None
            msgs.append({"role": role, "content": m.get("value", m.get("content"))})
        return msgs
    for q, a in (("input", "output"), ("problem", "solution"), ("prompt", "response"), ("prompt", "completion"), ("question", "answer")):
        if isinstance(example.get(q), str) and isinstance(example.get(a), str):  # AceReason-1.1-SFT: input/output
            return [{"role": "user", "content": example[q]}, {"role": "assistant", "content": example[a]}]
    return None


def encode_chat(tokenizer, messages: list[dict], seq_len: int | None) -> tuple[list[int], list[bool]] | None:
    """Token ids and loss mask (True on assistant tokens) of a chat, truncated to seq_len (None: whole).

    The template is rendered for growing prefixes of the chat, so the text each turn adds
    is known exactly; the assistant's share (after the generation prompt) is the loss
    part. Returns None if no loss token survives truncation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template; training renders chats with it (add one to tokenizer_config.json)")

    def render(msgs, gen=False) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    segments = _segments(render, messages)
    if segments is None:  # the template rewrites earlier turns (e.g. drops old reasoning): last turn only
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return None
        prompt, full = render(messages[:last], gen=True), render(messages[: last + 1])
        if not full.startswith(prompt):
            return None
        reply = full[len(prompt):]
        segments = [(prompt, False), (reply.rstrip(), True), (reply[len(reply.rstrip()):], False)]
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_loss in segments:
        if not text:
            continue
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        mask.extend([is_loss] * len(piece))
    if seq_len is not None:
        ids, mask = ids[:seq_len], mask[:seq_len]
    # the first token is never a target (nothing predicts it)
    if len(ids) < 2 or not any(mask[1:]):
        return None
    return ids, mask


def _segments(render, messages: list[dict]) -> list[tuple[str, bool]] | None:
    """(text, is_loss) pieces whose concatenation is the rendered chat; None if prefixes do not nest."""
    segments, done = [], ""
    for i, msg in enumerate(messages):
        full = render(messages[: i + 1])
        if msg["role"] == "assistant":
            prompt = render(messages[:i], gen=True)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                return None
            reply = full[len(prompt):]
            kept = reply.rstrip()  # whitespace the template puts after the end-of-turn token is not a target
            segments += [(prompt[len(done):], False), (kept, True), (reply[len(kept):], False)]
        else:
            if not full.startswith(done):
                return None
            segments.append((full[len(done):], False))
        done = full
    return segments


# --- sources ---------------------------------------------------------------------------------------


class Source:
    """An endless, seeded sequence of raw examples, walked epoch by epoch; resumable."""

    def __init__(self, spec: dict, seed: int, shuffle_buffer: int) -> None:
        self.spec, self.seed, self.shuffle_buffer = spec, seed, shuffle_buffer
        self.epoch, self.offset = 0, 0  # position: examples consumed within the current epoch
        self._it: Iterator | None = None

    def _epoch_iter(self, epoch: int, offset: int) -> Iterator[dict]:
        raise NotImplementedError

    def next(self) -> dict:
        for _ in range(2):
            if self._it is None:
                self._it = self._epoch_iter(self.epoch, self.offset)
            try:
                item = next(self._it)
                self.offset += 1
                return item
            except StopIteration:
                if self.offset == 0:
                    break
                self.epoch, self.offset, self._it = self.epoch + 1, 0, None
        raise UserError(f"data source {self.spec} yielded no examples")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset, self._it = int(state["epoch"]), int(state["offset"]), None


class ListSource(Source):
    """An in-memory list (the synthetic task), reshuffled every epoch."""

    def __init__(self, items: list[dict], spec: dict, seed: int, shuffle_buffer: int = 0) -> None:
        super().__init__(spec, seed, shuffle_buffer)
        self.items = items

    def _epoch_iter(self, epoch: int, offset: int) -> Iterator[dict]:
        order = list(range(len(self.items)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return (self.items[i] for i in order[offset:])


class StreamSource(Source):
    """A `datasets` streaming dataset (Hub or local files), shuffled with a buffer per epoch."""

    def __init__(self, spec: dict, seed: int, shuffle_buffer: int) -> None:
        super().__init__(spec, seed, shuffle_buffer)
        self._dataset = None

    def _load(self):
        from datasets import load_dataset

        spec = self.spec
        if spec["source"] == "hub":
            try:
                return load_dataset(spec["path"], name=spec.get("name"), split=spec.get("split", "train"), streaming=True)
            except Exception as exc:  # offline, gated, renamed
                raise UserError(
                    f"cannot stream {spec['path']} from the Hugging Face Hub ({type(exc).__name__}: {str(exc)[:120]}); "
                    "download it where the Hub is reachable and use {source: local, path: <files>} instead"
                ) from None
        files = sorted(glob.glob(str(Path(spec["path"]).expanduser())))
        if not files:
            raise UserError(f"local data {spec['path']!r} matches no files")
        for f in files:
            check_local_file(Path(f))
        suffixes = {Path(f).suffix for f in files}
        fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffixes.pop()) if len(suffixes) == 1 else None
        if fmt is None:
            raise UserError(f"local data {spec['path']!r}: use .jsonl, .json or .parquet files (one format per source)")
        return load_dataset(fmt, data_files=files, split="train", streaming=True)

    def _epoch_iter(self, epoch: int, offset: int) -> Iterator[dict]:
        if self._dataset is None:
            self._dataset = self._load()
        ds = self._dataset
        if self.shuffle_buffer > 1:
            ds = ds.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        if offset:
            ds = ds.skip(offset)
        return iter(ds)


def check_local_file(path: Path) -> None:
    """A local training file must be a regular file (a FIFO or a device would block or never end) and,
    for JSON, UTF-8 text: one line now rather than a traceback from the data loader mid-run."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise UserError(f"local data {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise UserError(f"local data {path} is {kind}; pass .jsonl, .json or .parquet files")
    if path.suffix not in (".jsonl", ".json"):
        return
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):  # streamed: a training file may be larger than memory
                decoder.decode(chunk)
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise UserError(f"local data {path} is not UTF-8 text (near byte {offset + exc.start}); save it as UTF-8") from None


def build_source(spec: dict, seed: int, shuffle_buffer: int) -> Source:
    if not isinstance(spec, dict) or spec.get("source") not in SOURCE_KINDS:
        raise UserError(f"data source {spec!r}: needs `source` set to one of {', '.join(SOURCE_KINDS)}")
    known = DATA_KEYS[spec["source"]]
    unknown = sorted(set(spec) - known)
    if unknown:
        raise UserError(f"data source {spec['source']}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    if spec["source"] in ("hub", "local") and not spec.get("path"):
        raise UserError(f"data source {spec['source']} needs a `path`")
    if spec["source"] == "synthetic":
        num_steps = spec.get("num_steps", 2)
        try:
            items = synthetic.make_split(
                spec.get("split", "train"), int(spec.get("n", 10_000)), int(spec.get("seed", 0)),
                num_steps=tuple(num_steps) if isinstance(num_steps, list) else int(num_steps),
                max_value=int(spec.get("max_value", 9)), form=spec.get("form", "variables"),
            )
        except ValueError as exc:
            raise UserError(f"data source synthetic: {exc}") from None
        target = spec.get("target", "answer")
        return ListSource([{"messages": synthetic.to_messages(x, target)} for x in items], spec, seed)
    return StreamSource(spec, seed, shuffle_buffer)


# --- the mixed, tokenized stream ---------------------------------------------------------------------


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]


class DataStream:
    """Examples from the recipe's sources, mixed by weight, tokenized; this process's share."""

    def __init__(self, specs: list[dict], tokenizer, seq_len: int, *, seed: int, shuffle_buffer: int = 10_000,
                 rank: int = 0, world_size: int = 1, overlong: str = "truncate") -> None:
        if not specs:
            raise UserError("the recipe lists no data sources")
        self.sources = [build_source(s, seed=seed * 1000 + i, shuffle_buffer=shuffle_buffer) for i, s in enumerate(specs)]
        weights = [float(s.get("weight", 1.0)) for s in specs]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"data source weights must be >= 0 with a positive sum, got {weights}")
        self.weights = weights
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.draws = 0  # mixer draws so far (the mixer RNG is replayed on resume)
        self.skipped = 0  # examples dropped (unknown schema is an error; empty after truncation is not)
        self.overlong = overlong  # longer than seq_len: "keep" whole, "truncate", or "drop"
        self.truncated = self.dropped = 0
        self._rng = random.Random(f"mix/{seed}")

    def _next_global(self) -> Example:
        while True:
            i = self._rng.choices(range(len(self.sources)), weights=self.weights)[0]
            self.draws += 1
            raw = self.sources[i].next()
            msgs = to_messages(raw)
            if msgs is None:
                raise UserError(
                    f"data source {self.sources[i].spec.get('path', self.sources[i].spec['source'])}: cannot make a chat "
                    f"from columns {sorted(raw)}; expected messages, conversations, input/output or problem/solution"
                )
            enc = encode_chat(self.tokenizer, msgs, None)
            if enc is not None and len(enc[0]) > self.seq_len:
                if self.overlong == "drop":
                    self.dropped += 1
                    continue
                if self.overlong == "truncate":
                    self.truncated += 1
                    ids, mask = enc[0][: self.seq_len], enc[1][: self.seq_len]
                    enc = (ids, mask) if any(mask[1:]) else None
            if enc is None:
                self.skipped += 1
                continue
            return Example(*enc)

    def next(self) -> Example:
        """This process's next example: every world_size-th of the global stream."""
        for _ in range(self.rank):
            self._next_global()
        ex = self._next_global()
        for _ in range(self.world_size - self.rank - 1):
            self._next_global()
        return ex

    def state_dict(self) -> dict:
        return {"draws": self.draws, "skipped": self.skipped, "truncated": self.truncated, "dropped": self.dropped,
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        self._rng = random.Random(f"mix/{self.seed}")
        for _ in range(state["draws"]):  # replay the mixer's choices; sources jump to their positions
            self._rng.choices(range(len(self.sources)), weights=self.weights)
        self.draws, self.skipped = state["draws"], state.get("skipped", 0)
        self.truncated, self.dropped = state.get("truncated", 0), state.get("dropped", 0)
        for src, st in zip(self.sources, state["sources"], strict=True):
            src.load_state_dict(st)


def bucket(examples: list[Example], micro_batch_size: int, pad_id: int, pad_multiple: int = 1) -> list[dict[str, torch.Tensor]]:
    """A step's examples as micro-batches of similar length (length bucketing): sorted longest
    first and cut into groups of `micro_batch_size`, so each row pads only to its group's longest.

    Which examples make the step is unchanged, and the loss is normalised by the step's token
    counts, so the step's gradient does not depend on the grouping. Every row is one whole
    document starting at column 0: its chunks count from its own first token. `pad_multiple`
    rounds each group's width up (a compiled layer step sees whole chunks only).
    """
    ordered = sorted(examples, key=lambda e: len(e.input_ids), reverse=True)
    return [collate(ordered[i : i + micro_batch_size], pad_id, pad_multiple) for i in range(0, len(ordered), micro_batch_size)]


def prompt_length(loss_mask: torch.Tensor) -> int:
    """The prompt length every row of a [B, L] loss mask reaches: the fewest tokens before a row's first
    reply token (0 when a row has none)."""
    has_reply = loss_mask.bool().any(dim=1)
    if not has_reply.all():
        return 0
    return int(loss_mask.bool().int().argmax(dim=1).min())


def collate(examples: list[Example], pad_id: int, pad_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, loss_mask [B, width], width the longest
    row rounded up to a multiple of `pad_multiple`."""
    width = -(-max(len(e.input_ids) for e in examples) // pad_multiple) * pad_multiple
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.bool)
    loss = torch.zeros((len(examples), width), dtype=torch.bool)
    for r, e in enumerate(examples):
        n = len(e.input_ids)
        ids[r, :n] = torch.tensor(e.input_ids)
        attn[r, :n] = True
        loss[r, :n] = torch.tensor(e.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
