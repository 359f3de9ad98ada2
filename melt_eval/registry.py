"""Known models: where each comes from and the architecture facts the memory table uses.

`melt_eval.modeling.loading.resolve_model_dir` turns a name into a local checkpoint directory: Hub models through `huggingface_hub`
(cached; works with HF_HUB_OFFLINE=1 once downloaded), `tiny-random-*` models are built
locally and deterministically on first use, `melt-1.6b` is whatever `melt-eval train`
wrote (set MELT_EVAL_MELT_1_6B or pass the checkpoint path). Any existing directory
may be given in place of a name, and so may any Hub id `ORG/NAME[@REVISION]` (fetched through
huggingface_hub's standard cache; these names are short aliases of Hub ids).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from melt_eval.errors import UserError
from melt_eval.cache_layout import CacheLayout, cache_layout


@dataclass(frozen=True)
class ModelSpec:
    name: str
    display: str  # the name the paper's tables use
    family: str  # "ouro" (LoopLM), "melt", or "hf" (any transformers causal LM)
    source: str  # "hub:<repo id>", "trained: <how>", or "built locally"
    # None where the architecture is not a plain attention stack the harness can describe
    num_layers: int | None
    hidden_size: int | None
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    params: int
    loops: int = 1
    # Set where the per-token KV size cannot be derived from a plain attention config
    # (sliding windows, linear attention, shared KV layers): the paper's vLLM reading.
    paper_vllm_kv_bytes_per_token: int | None = None
    notes: str = ""
    tiny: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def hub_id(self) -> str | None:
        return self.source[4:] if self.source.startswith("hub:") else None

    def cache_layout(self, loops: int | None = None, kv_sharing: str | None = None) -> CacheLayout:
        """The model's KV cache at its own (or `loops`) T; `family` is the model type it decides by."""
        return cache_layout(self.family, loops=loops or self.loops, layers=self.num_layers, kv_heads=self.num_kv_heads,
                            head_dim=self.head_dim, kv_sharing=kv_sharing)

    @property
    def kv_entries_per_layer(self) -> int:
        """KV entries per (layer, token): T for Ouro, 1 for MELT and non-looped models."""
        return self.cache_layout().entries_per_token()[1] if self.num_layers is not None else 1

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 KV bytes per token: 2 (K and V) x entries x layers x kv_heads x head_dim x 2 bytes."""
        if self.paper_vllm_kv_bytes_per_token is not None:
            return self.paper_vllm_kv_bytes_per_token
        return self.cache_layout().bytes_per_token()

    @property
    def kv_source(self) -> str:
        return "paper (vLLM reading)" if self.paper_vllm_kv_bytes_per_token is not None else "analytic"

    def as_dict(self) -> dict:
        fields = asdict(self)
        fields.pop("extra")
        d = {}
        for key, value in fields.items():  # the derived entry count sits after loops, where it always has
            d[key] = value
            if key == "loops":
                d["kv_entries_per_layer"] = self.kv_entries_per_layer
        d.update(hub_id=self.hub_id, kv_bytes_per_token=self.kv_bytes_per_token, kv_source=self.kv_source)
        return d


def _ouro_params(num_layers: int, d: int = 2048, inter: int = 5632, vocab: int = 49152) -> int:
    per_layer = 4 * d * d + 3 * d * inter + 4 * d  # q,k,v,o + SwiGLU + four sandwich norms
    return 2 * vocab * d + num_layers * per_layer + d + (d + 1)  # embed + untied head, norm, early-exit gate


def melt_gate_params(num_layers: int, d: int, gate: str = "elementwise") -> int:
    """New parameters MELT adds to a LoopLM (docs/method.md#gates)."""
    per_layer = {"elementwise": 2 * d * d + d, "scalar": 2 * d + 1}.get(gate, 0)
    return num_layers * per_layer


_OURO_1_4B = _ouro_params(24)

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            "melt-1.6b", "MELT-1.6B", "melt", "trained: melt-eval train (paper-phase1, paper-phase2)",
            24, 2048, 16, 16, 128, _OURO_1_4B + melt_gate_params(24, 2048), loops=4,
            notes="not released; set MELT_EVAL_MELT_1_6B=<checkpoint dir> or pass the path",
        ),
        ModelSpec(
            "ouro-1.4b-thinking", "Ouro-1.4B-Thinking", "ouro", "hub:ByteDance/Ouro-1.4B-Thinking",
            24, 2048, 16, 16, 128, _OURO_1_4B, loops=4,
        ),
        ModelSpec(
            "ouro-2.6b-thinking", "Ouro-2.6B-Thinking", "ouro", "hub:ByteDance/Ouro-2.6B-Thinking",
            48, 2048, 16, 16, 128, _ouro_params(48), loops=4,
        ),
        ModelSpec(
            "qwen3-1.7b", "Qwen3-1.7B", "hf", "hub:Qwen/Qwen3-1.7B",
            28, 2048, 16, 8, 128, 1_720_574_976, notes="GQA, tied embeddings",
        ),
        ModelSpec(
            "gemma4-e2b", "Gemma4-E2B", "hf", "hub:google/gemma-4-E2B",
            None, None, None, None, None, 2_333_000_000, paper_vllm_kv_bytes_per_token=35_840,
            notes="sliding-window and KV-shared layers: per-token KV is the paper's vLLM reading; "
            "params = paper model bytes / 2",
        ),
        ModelSpec(
            "qwen3.5-2b", "Qwen3.5-2B", "hf", "hub:Qwen/Qwen3.5-2B",
            None, None, None, None, None, 1_882_000_000, paper_vllm_kv_bytes_per_token=49_152,
            notes="hybrid linear/full attention: per-token KV is the paper's vLLM reading; "
            "params = paper model bytes / 2",
        ),
        ModelSpec(
            "deepseek-r1-1.5b", "DeepSeek-R1-1.5B", "hf", "hub:deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
            28, 1536, 12, 2, 128, 1_777_088_000, notes="Qwen2.5-Math-1.5B architecture, GQA",
        ),
        ModelSpec(
            "tiny-random-ouro", "tiny-random-ouro", "ouro", "built locally",
            2, 128, 2, 2, 64, 0, loops=4, tiny=True,
            notes="random weights, byte-level BPE tokenizer; for offline tests",
        ),
        ModelSpec(
            "tiny-random-melt", "tiny-random-melt", "melt", "built locally",
            2, 128, 2, 2, 64, 0, loops=4, tiny=True,
            notes="tiny-random-ouro + elementwise gates (seed 0)",
        ),
        ModelSpec(
            "tiny-random-melt-gqa", "tiny-random-melt-gqa", "melt", "built locally",
            2, 128, 2, 1, 64, 0, loops=4, tiny=True,
            notes="tiny-random-melt with its 2 key/value heads mean-pooled into 1 (grouped-query MELT, kv_heads: 1)",
        ),
        ModelSpec(
            "tiny-random-llama", "tiny-random-llama", "hf", "built locally",
            2, 128, 2, 1, 64, 0, tiny=True, notes="plain transformers Llama, for the non-looped path",
        ),
    ]
}


def cache_home() -> Path:
    """Where built tiny models live (MELT_EVAL_HOME, else ~/.cache/melt-eval)."""
    return Path(os.environ.get("MELT_EVAL_HOME", Path.home() / ".cache" / "melt-eval"))


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UserError(
            f"unknown model {name!r}; known models: {', '.join(MODELS)} (or pass a checkpoint directory or a Hugging Face Hub id ORG/NAME[@REVISION])"
        ) from None
