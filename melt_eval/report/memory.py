"""Memory accounting (docs/method.md#caches): KV bytes per token, model bytes, KV and total for a context.

Figures are exact bytes; the paper's are decimal MB/GB. The paper's own columns disagree with each
other (its "KV-cache for 32k" is 32,000 x per-token although its text says 32,768, and its totals are
not model + KV), so every row carries the paper's figures next to ours plus the sums and the implied
token count that expose the disagreement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from melt_eval.errors import UserError
from melt_eval.cache_layout import layout_of
from melt_eval.jsonio import read_text
from melt_eval.registry import MODELS, ModelSpec, get_spec
from melt_eval.report.paper import paper_memory
from melt_eval.report.render import Cell, Row, Table

GB = 1e9  # the paper's GB and MB are decimal
MB = 1e6
DEFAULT_CONTEXTS = (32_000, 32_768)
BYTES_PER_PARAM = 2  # bf16


def default_models() -> list[str]:
    """Every full-size registry model (tiny test models have no parameter count)."""
    return [name for name, spec in MODELS.items() if not spec.tiny]


@dataclass
class ContextMemory:
    tokens: int
    kv_bytes: int
    total_bytes: int | None  # None when the parameter count is unknown


@dataclass
class PaperMemory:
    label: str
    kv_mb_per_token: float
    model_gb: float
    kv_gb_32k: float
    total_gb_32k: float
    commented_out: bool  # the paper has the row but comments it out of the printed table
    model_plus_kv_gb: float  # what its total would be if it were model + KV
    # The context (32,000 or 32,768) whose KV, rounded as the paper prints it, gives its "32k" figure.
    kv_32k_tokens: int | None

    @property
    def total_is_model_plus_kv(self) -> bool:
        return abs(self.total_gb_32k - self.model_plus_kv_gb) < 0.006  # figures printed to 2 decimals


@dataclass
class MemoryRow:
    model: str
    display: str
    kv_bytes_per_token: int
    kv_source: str  # "analytic" or "paper (vLLM reading)"
    params: int | None
    model_bytes: int | None
    loops: int
    contexts: list[ContextMemory]
    paper: PaperMemory | None
    measured: dict | None = field(default=None)  # from `--measure vllm`

    def context(self, tokens: int) -> ContextMemory:
        return next(c for c in self.contexts if c.tokens == tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(spec: ModelSpec, loops: int | None = None) -> int:
    """bf16 KV bytes per token; `loops` overrides T for looped models whose cache grows with T (Ouro)."""
    if loops is None or spec.kv_entries_per_layer == 1:
        return spec.kv_bytes_per_token  # MELT and non-looped models: one entry per (layer, token)
    if spec.num_layers is None:
        raise UserError(f"{spec.name}: KV size per loop is not derivable from its config")
    return spec.cache_layout(loops).bytes_per_token()


def kv_bytes_per_token_at(model: str, model_path: str | None, loops: int | None, kv_sharing: str | None = None) -> int | None:
    """bf16 KV bytes per generated token of a run at `loops` loops: from the registry entry, else from the
    checkpoint's config.json; None where neither describes it. With KV sharing an Ouro keeps one entry per
    generated token; the "w/ prefill" rows also keep T per prompt token, which `CacheLayout.nbytes`
    counts where the prompt's length is known (the engine's measured `peak_cache_bytes` includes it)."""
    import json
    from pathlib import Path

    if model in MODELS and not MODELS[model].tiny:
        spec = MODELS[model]
        if kv_sharing:
            return spec.cache_layout(loops, kv_sharing).bytes_per_token() if spec.num_layers is not None else None
        try:
            return kv_bytes_per_token(spec, loops)
        except UserError:
            return None
    cfg_path = Path(model_path) / "config.json" if model_path else None
    if cfg_path is None or not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(read_text(cfg_path, "a config.json"))
        return layout_of(cfg, loops=loops, kv_sharing=kv_sharing).bytes_per_token(BYTES_PER_PARAM)
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def _paper_row(spec: ModelSpec) -> PaperMemory | None:
    row = paper_memory(spec.display)
    if row is None:
        return None
    per_token = row["kv_mb_per_token"] * MB
    return PaperMemory(
        label=row["paper_label"],
        kv_mb_per_token=row["kv_mb_per_token"],
        model_gb=row["model_gb"],
        kv_gb_32k=row["kv_gb_32k"],
        total_gb_32k=row["total_gb_32k"],
        commented_out=row["commented_out"],
        model_plus_kv_gb=round(row["model_gb"] + row["kv_gb_32k"], 3),
        kv_32k_tokens=next(
            (t for t in (32_000, 32_768) if abs(round(per_token * t / GB, 2) - row["kv_gb_32k"]) < 1e-9), None
        ),
    )


def memory_row(name: str, contexts=DEFAULT_CONTEXTS) -> MemoryRow:
    spec = get_spec(name)
    per_token = spec.kv_bytes_per_token
    # Tiny models carry params=0 in the registry: unknown, not zero.
    params = spec.params or None
    model_bytes = BYTES_PER_PARAM * params if params else None
    return MemoryRow(
        model=spec.name,
        display=spec.display,
        kv_bytes_per_token=per_token,
        kv_source=spec.kv_source,
        params=params,
        model_bytes=model_bytes,
        loops=spec.loops,
        contexts=[
            ContextMemory(t, per_token * t, None if model_bytes is None else model_bytes + per_token * t)
            for t in contexts
        ],
        paper=_paper_row(spec),
    )


MAX_CONTEXT = 2**31 - 1  # beyond it the byte counts lose their last digits in the table's floats


def memory_table(models=None, contexts=DEFAULT_CONTEXTS) -> list[MemoryRow]:
    from melt_eval.registry import MODELS

    if models is not None and not list(models):
        raise UserError("--models names no model; pass registry names (melt-eval models lists them), or leave it out "
                        "for the paper's")
    models = list(models) if models else default_models()
    unknown = [m for m in models if m not in MODELS]
    if unknown:  # the table is the registry's analytic figures: a checkpoint directory or Hub id has none here
        raise UserError(f"--models takes the registry's names, not {unknown[0]!r}; known: {', '.join(MODELS)}")
    if not contexts:
        raise UserError("--context needs at least one token count, e.g. --context 32000,32768")
    if any(t <= 0 or t > MAX_CONTEXT for t in contexts):
        raise UserError(f"--context takes token counts from 1 to {MAX_CONTEXT:,}, got {list(contexts)}")
    return [memory_row(m, contexts) for m in models]


def paper_notes(rows: list[MemoryRow]) -> list[str]:
    """Sentences describing where the paper's memory columns disagree, computed from its figures."""
    with_paper = [r for r in rows if r.paper is not None]
    notes = []
    matched = {r.paper.kv_32k_tokens for r in with_paper}
    if matched == {32_000}:
        notes.append(
            "The paper's 'KV-cache for 32k' column is 32,000 tokens x its per-token figure (decimal GB) in every row, "
            "although its text defines 32k as 32,768 tokens."
        )
    elif with_paper:
        notes.append(
            "The paper's 'KV-cache for 32k' column matches "
            + ", ".join(f"{r.paper.label}: {r.paper.kv_32k_tokens or 'neither 32,000 nor 32,768'}" for r in with_paper)
            + " tokens x its per-token figure."
        )
    bad = [r for r in with_paper if not r.paper.total_is_model_plus_kv]
    if bad:
        notes.append(
            "The paper's totals are not model + KV: "
            + "; ".join(
                f"{r.paper.label} {r.paper.total_gb_32k:.2f} vs {r.paper.model_gb:.3f} + {r.paper.kv_gb_32k:.2f} = "
                f"{r.paper.model_plus_kv_gb:.2f}"
                for r in bad
            )
            + " GB."
        )
    if any(r.paper.commented_out for r in with_paper):
        notes.append("Rows marked with a dagger are commented out of the paper's printed table (kept in its source).")
    if any(r.kv_source != "analytic" for r in rows):
        notes.append(
            "Per-token KV marked * is the paper's vLLM reading: sliding-window, shared-KV or linear-attention "
            "layers make it underivable from a plain attention config."
        )
    return notes


# ---------------------------------------------------------------- as a table (melt_eval.report.render prints it)


def to_json(rows: list[MemoryRow]) -> list[dict]:
    return [r.as_dict() for r in rows]


def as_table(rows: list[MemoryRow], contexts) -> Table:
    """`melt-eval memory`: our exact figures for each context (and vLLM's, if measured), then the paper's
    columns as printed."""
    measured = any(r.measured for r in rows)
    ours = ["KV B/token", "params (B)", "model GB"]
    ours += [h for t in contexts for h in (f"KV GB @{t:,}", f"total GB @{t:,}")]
    ours += ["vLLM KV B/token"] if measured else []
    theirs = ["KV MB/token", "model GB", "KV 32k GB", "total 32k GB", "model+KV GB"]

    def gb(n: int | None) -> Cell:
        return Cell(None if n is None else n / GB, digits=3)

    table_rows = []
    for r in rows:
        cells = [Cell(r.kv_bytes_per_token, digits=0, thousands=True, footnote="*" if r.kv_source != "analytic" else ""),
                 Cell(r.params / 1e9 if r.params else None, digits=3), gb(r.model_bytes)]
        for t in contexts:
            cells += [gb(r.context(t).kv_bytes), gb(r.context(t).total_bytes)]
        if measured:
            cells.append(Cell(r.measured["kv_bytes_per_token"] if r.measured else None, digits=0, thousands=True))
        p = r.paper
        cells += [Cell(v, digits=d) for v, d in zip(
            [p.kv_mb_per_token, p.model_gb, p.kv_gb_32k, p.total_gb_32k, p.model_plus_kv_gb] if p else [None] * 5,
            (6, 3, 2, 2, 2))]
        table_rows.append(Row([r.display + (" \u2020" if p and p.commented_out else "")], cells))
    return Table(
        key="memory_reproduced",
        title="KV cache and model memory (bf16); ours exact, paper's as printed",
        caption="KV-cache and model memory in bf16 (GB $=10^9$ bytes).",
        stub_heads=["Model"],
        heads=ours + theirs,
        rows=table_rows,
        groups=[("ours", len(ours)), ("paper", len(theirs))],
        notes=paper_notes(rows) + measured_notes(rows),
        source="arithmetic",
    )


def measured_notes(rows: list[MemoryRow]) -> list[str]:
    """Where vLLM's allocation agrees with the arithmetic and where it does not."""
    got = [r for r in rows if r.measured]
    same = [r.display for r in got if r.measured["kv_bytes_per_token"] == r.kv_bytes_per_token]
    differ = [f"{r.display} ({r.measured['kv_bytes_per_token']:,} vs {r.kv_bytes_per_token:,})" for r in got
              if r.measured["kv_bytes_per_token"] != r.kv_bytes_per_token]
    notes = []
    if same:
        notes.append("vLLM's KV bytes per token equal ours for " + ", ".join(same) + ".")
    if differ:
        notes.append("vLLM's KV bytes per token differ from ours for " + "; ".join(differ) + ".")
    return notes
