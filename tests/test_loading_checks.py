"""Loading that checks the checkpoint: config and weights agree, broken files are one-line errors
naming the file, and a corrupt cached tiny model is rebuilt."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from melt_eval.modeling import load_model
from melt_eval.modeling.loading import resolve_model_dir

from helpers import copy_checkpoint as _copy
from helpers import refused_load as _refused
from helpers import main_exit_code as _main


def _edit_config(ckpt, **changes):
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))


_DROP = object()


def _edit_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # the file is rewritten below
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# --- weights files ---------------------------------------------------------------------------

def _truncate(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _cut_header(p):
    p.write_bytes(p.read_bytes()[:40])


def _random_bytes(p):
    p.write_bytes(os.urandom(p.stat().st_size))


def _zero_length(p):
    p.write_bytes(b"")


def _padded(p):
    p.write_bytes(p.read_bytes() + b"\0" * 64)


@pytest.mark.parametrize("corrupt", [_truncate, _cut_header, _random_bytes, _zero_length, _padded])
@pytest.mark.parametrize("model", ["tiny-random-ouro", "tiny-random-llama"])
def test_corrupt_safetensors_names_the_file(tiny_dirs, tmp_path, corrupt, model):
    ckpt = _copy(tiny_dirs, tmp_path, model)
    corrupt(ckpt / "model.safetensors")
    _refused(ckpt, str(ckpt / "model.safetensors"), "not a valid safetensors file")


def test_integer_weights_are_refused(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs, tmp_path)
    _edit_weights(ckpt, lambda t: t.update({k: v.to(torch.int64) for k, v in t.items() if "embed" in k}))
    _refused(ckpt, "model.safetensors", "I64", "not a floating-point type")


# --- config and weights agree ------------------------------------------------------------------

@pytest.mark.parametrize(
    "model, changes, fragments",
    [
        # a LoopLM labelled llama must not run as Llama with half its tensors ignored
        ("tiny-random-ouro", dict(model_type="llama", architectures=_DROP), ["tensors the config has no place for"]),
        ("tiny-random-ouro", dict(model_type="llama"), ["model_type 'llama' does not match", "LoopLMForCausalLM"]),
        ("tiny-random-melt", dict(model_type="ouro", architectures=["LoopLMForCausalLM"]), ["melt_gate"]),
        ("tiny-random-ouro", dict(model_type="melt", architectures=["MeltForCausalLM"]), ["missing tensors"]),
        ("tiny-random-ouro", dict(num_hidden_layers=1), ["layers.1.", "num_hidden_layers"]),
        ("tiny-random-ouro", dict(num_hidden_layers=3), ["missing tensors", "layers.2."]),
        ("tiny-random-ouro", dict(hidden_size=64), ["shape mismatches"]),
        ("tiny-random-ouro", dict(total_ut_steps=0), ["total_ut_steps must be a whole number >= 1, got 0"]),
        ("tiny-random-ouro", dict(total_ut_steps=-2), ["got -2"]),
        ("tiny-random-ouro", dict(total_ut_steps=1.5), ["got 1.5"]),
        ("tiny-random-melt", dict(hidden_size="128"), ["hidden_size must be a whole number", "'128'"]),
        ("tiny-random-ouro", dict(model_type=_DROP), ["has no model_type"]),
        ("tiny-random-llama", dict(model_type=_DROP), ["has no model_type"]),
        ("tiny-random-llama", dict(num_hidden_layers=1), ["tensors the config has no place for"]),
        ("tiny-random-llama", dict(hidden_size="128"), ["cannot load"]),
    ],
)
def test_config_and_weights_must_agree(tiny_dirs, tmp_path, model, changes, fragments):
    ckpt = _copy(tiny_dirs, tmp_path, model)
    _edit_config(ckpt, **changes)
    _refused(ckpt, *fragments)


def test_an_extra_tensor_is_not_silently_ignored(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs, tmp_path)
    _edit_weights(ckpt, lambda t: t.update({"model.extra.weight": torch.zeros(4, 4)}))
    _refused(ckpt, "model.extra.weight")


@pytest.mark.parametrize(
    "content, fragments",
    [
        (b"[1, 2, 3]", ["must be a JSON object", "list"]),
        (b'"ouro"', ["must be a JSON object", "str"]),
        (b"\xff\xfe{\x00}", ["not UTF-8"]),
        (b'{"model_type": "ouro",', ["not valid JSON"]),
        (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),
        (b"", ["not valid JSON"]),
    ],
)
def test_broken_config_json_names_the_file(tiny_dirs, tmp_path, content, fragments):
    ckpt = _copy(tiny_dirs, tmp_path)
    (ckpt / "config.json").write_bytes(content)
    _refused(ckpt, str(ckpt / "config.json"), *fragments)


def test_config_json_that_is_a_directory(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs, tmp_path)
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    _refused(ckpt, "config.json", "is a directory")


@pytest.mark.parametrize(
    "file, content",
    [("tokenizer.json", b"\x00\xff garbage \xfe"), ("tokenizer.json", b'{"version": "1.0", "model": 5}'),
     ("tokenizer.json", b"[]"), ("tokenizer_config.json", b"\x00\xff garbage \xfe"), ("tokenizer_config.json", b"[]")],
)
def test_garbage_tokenizer_files_are_one_line(tiny_dirs, tmp_path, file, content):
    ckpt = _copy(tiny_dirs, tmp_path)
    (ckpt / file).write_bytes(content)
    _refused(ckpt, "cannot load the tokenizer of", str(ckpt), file)


def test_good_checkpoints_still_load(tiny_dirs):
    for name in tiny_dirs:
        model, tok = load_model(name)
        assert model is not None and tok is not None


# --- the tiny-model cache ------------------------------------------------------------------------

@pytest.mark.parametrize("corrupt", [_truncate, _random_bytes, _zero_length])
def test_a_corrupt_cached_tiny_model_is_rebuilt(tmp_path, monkeypatch, corrupt):
    monkeypatch.setenv("MELT_EVAL_HOME", str(tmp_path / "home"))
    first = resolve_model_dir("tiny-random-melt")
    reference = {k: v.clone() for k, v in load_file(first / "model.safetensors").items()}  # not a view of the mmap
    corrupt(first / "model.safetensors")
    again = resolve_model_dir("tiny-random-melt")
    assert again == first
    rebuilt = load_file(again / "model.safetensors")
    assert rebuilt.keys() == reference.keys() and all(torch.equal(rebuilt[k], reference[k]) for k in reference)
    model, _ = load_model("tiny-random-melt")
    assert model.config.total_ut_steps == 4


def test_a_cached_tiny_model_with_a_broken_config_or_tokenizer_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MELT_EVAL_HOME", str(tmp_path / "home"))
    first = resolve_model_dir("tiny-random-ouro")
    (first / "config.json").write_text("[]")
    (first / "tokenizer.json").write_bytes(b"\xff")
    load_model("tiny-random-ouro")  # rebuilt, then loads


# --- the CLI ---------------------------------------------------------------------------------------



def test_run_on_a_broken_checkpoint_is_one_line_and_writes_nothing(tiny_dirs, tmp_path, capsys):
    ckpt = _copy(tiny_dirs, tmp_path)
    _edit_config(ckpt, total_ut_steps=0)
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", str(ckpt), "--max-problems", "1", "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "total_ut_steps" in err, err
    assert not list(out.rglob("results.json")) if out.exists() else True
