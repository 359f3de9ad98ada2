"""Tiny random models built locally and deterministically, so every command runs offline.

`tiny-random-ouro` (a LoopLM), `tiny-random-melt` (the same weights + elementwise gates,
seed 0), `tiny-random-melt-gqa` (the same, its two key/value heads mean-pooled into one) and `tiny-random-llama` (a plain transformers Llama, for the non-looped path)
share one byte-level BPE tokenizer trained with the `tokenizers` library on a fixed
synthetic corpus, with a ChatML chat template like Ouro's. head_dim is 64 because
vLLM's CPU attention does not support 16.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from melt_eval.modeling.looplm import LoopLMConfig, LoopLMForCausalLM
from melt_eval.modeling.melt import MeltForCausalLM
from melt_eval.modeling.quiet import quiet_transformers
from melt_eval.synthetic import make_split

BUILD_VERSION = 2  # bump when a builder changes, so cached copies are rebuilt
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATE_TEXT = "user\n{problem}\nassistant\n\\boxed{{{answer}}}\n"  # the template's text, special tokens aside
TINY_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, head_dim=64)


def _corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    words = (
        "the answer is let so then we have find compute sum product value variable step each final "
        "problem solve number integer total remainder please reason put your within boxed"
    ).split()
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"{rng.choice(words)} {a} {op} {b} = {eval(f'{a}{op}{b}')} so \\boxed{{{a}}}.")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        lines.append(f"x = {a}; y = x + {b}; z = y * 2. What is z? \\boxed{{{2 * (a + b)}}}")
    # The demo's synthetic task in its chat form (train split only), so that its problems and the
    # template's role names take few tokens: training and decoding cost grow with the length.
    for item in make_split("train", n_lines // 2, seed=SEED, num_steps=(1, 3)):
        lines.append(CHAT_TEMPLATE_TEXT.format(problem=item["problem"], answer=item["answer"]))
    return lines


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _ids(tok) -> dict:
    return dict(
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|pad|>"),
    )


def make_tiny_looplm(tok, loops: int = 4, **dims):
    config = LoopLMConfig(
        vocab_size=len(tok), total_ut_steps=loops, max_position_embeddings=4096, rope_theta=10000.0,
        **{**TINY_DIMS, **dims}, **_ids(tok),
    )
    config.architectures = ["LoopLMForCausalLM"]
    torch.manual_seed(SEED)
    return LoopLMForCausalLM(config)


def _make_llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), num_key_value_heads=1, max_position_embeddings=4096, **TINY_DIMS, **_ids(tok)
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


STAMP = "melt_eval_build.json"


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.is_file() and p.name != STAMP}


def _intact(target: Path) -> bool:
    """A cached build of this version whose files are byte for byte what was built (a few MB to hash);
    anything else (a cut or corrupted file, a missing one, an old build) is rebuilt."""
    try:
        stamp = json.loads((target / STAMP).read_text())
        if not (isinstance(stamp, dict) and stamp.get("version") == BUILD_VERSION and isinstance(stamp.get("files"), dict)
                and stamp["files"]):
            return False
        # files added later (by a library writing beside the weights) are not the build's: left alone
        return all(hashlib.sha256((target / name).read_bytes()).hexdigest() == digest
                   for name, digest in stamp["files"].items())
    except (OSError, ValueError, TypeError):
        return False


def build_tiny_model(name: str, root: Path) -> Path:
    """Build (once) and return the checkpoint directory of a tiny-random-* model."""
    target = Path(root) / name
    if _intact(target):
        return target
    tok = build_tokenizer()
    if name == "tiny-random-ouro":
        model = make_tiny_looplm(tok)
    elif name == "tiny-random-melt":
        model = MeltForCausalLM.from_looplm(make_tiny_looplm(tok), gate="elementwise", seed=SEED)
    elif name == "tiny-random-melt-gqa":  # grouped-query MELT (recipe kv_heads: 1): one key/value head
        model = MeltForCausalLM.from_looplm(make_tiny_looplm(tok), gate="elementwise", seed=SEED, kv_heads=1)
    elif name == "tiny-random-llama":
        model = _make_llama(tok)
    else:
        raise ValueError(f"no tiny builder for {name!r}")
    # Build next to the target and rename, so a concurrent or interrupted build never
    # leaves a half-written checkpoint behind.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    with quiet_transformers():
        model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    stamp = {"version": BUILD_VERSION, "seed": SEED, "name": name, "files": _digests(tmp)}
    (tmp / STAMP).write_text(json.dumps(stamp))
    # Another process building the same model at the same time may have put its build in place while this one
    # built: keep it. Removing it would pull its files from under that process (or a third), which may be
    # loading them already; the builds are byte for byte the same.
    if _intact(target):
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    if target.exists():  # a damaged or older build: moved aside in one rename, never deleted in place
        old = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=target.parent))
        try:
            os.replace(target, old / name)
        except OSError:  # gone meanwhile (another builder moved it aside)
            pass
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process put its build in place after the check above: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    return target
