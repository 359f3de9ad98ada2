"""Models by Hugging Face Hub id (`--model ORG/NAME[@REVISION]`) through huggingface_hub's standard cache,
offline; and every argument that can be checked locally checked before any network, dataset or model load
(issue 38 items 1 and 2)."""

import json
import shutil
import socket
import time

import pytest

from helpers import main_exit_code as _main
from helpers import one_line_error as _one_line_error

SHA = "0123456789abcdef0123456789abcdef01234567"
TINY_RUN = ["--max-problems", "1", "--samples", "1", "--max-new-tokens", "4", "--no-progress"]


def _snapshot(hub, repo_id: str, files_from=None, config=None, sha: str = SHA):
    """A model in the standard cache layout: models--ORG--NAME/{snapshots/<sha>/, refs/main}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    if files_from is not None:
        shutil.copytree(files_from, snap)
    else:
        snap.mkdir(parents=True)
    if config is not None:
        (snap / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE=tmp/hub holding org/name (tiny-random-melt's files) and org/llama (tiny-random-llama's)."""
    from huggingface_hub import constants

    from melt_eval.modeling.loading import resolve_model_dir

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    _snapshot(hub, "org/name", resolve_model_dir("tiny-random-melt"))
    _snapshot(hub, "org/llama", resolve_model_dir("tiny-random-llama"))
    return hub


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection of this process is recorded and refused."""
    calls = []

    def refuse(self, address, *args, **kwargs):
        calls.append(address)
        raise OSError(f"test: no network ({address})")

    def refuse_create(address, *args, **kwargs):
        calls.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse_create)
    return calls


# --- item 1: models by Hub id ------------------------------------------------------------------------


def test_run_by_hub_id_from_the_local_cache(hub_cache, tmp_path, no_network):
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", "org/name", "--output", out, *TINY_RUN]) == 0
    result = json.loads((out / "name" / "synthetic" / "results.json").read_text())
    assert result["finished"] is True and result["model"] == "name"
    assert result["model_path"].endswith(f"models--org--name/snapshots/{SHA}")
    assert no_network == []


def test_run_by_hub_id_at_a_revision(hub_cache, tmp_path, no_network):
    out = tmp_path / "out"
    assert _main(["run", "synthetic", "--model", f"org/name@{SHA}", "--output", out, *TINY_RUN]) == 0
    assert json.loads((out / f"name@{SHA}" / "synthetic" / "results.json").read_text())["finished"] is True
    assert no_network == []


def test_library_resolves_hub_ids_and_revisions(hub_cache, no_network):
    from melt_eval.modeling import load_model
    from melt_eval.modeling.loading import resolve_model_dir

    snap = hub_cache / "models--org--name" / "snapshots" / SHA
    assert resolve_model_dir("org/name") == snap
    assert resolve_model_dir("org/name", revision=SHA) == snap
    assert resolve_model_dir(f"org/name@{SHA}") == snap
    model, tokenizer = load_model("org/llama", revision="main")  # any causal LM, through transformers' classes
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer is not None
    model, _ = load_model("org/name")  # a MELT checkpoint, through the harness's own class
    assert type(model).__name__ == "MeltForCausalLM"
    assert no_network == []


def test_a_missing_hub_model_is_one_line_naming_it_fast(hub_cache, tmp_path, capsys, no_network):
    started = time.monotonic()
    code = _main(["run", "synthetic", "--model", "org/missing", "--output", tmp_path / "o", *TINY_RUN])
    assert time.monotonic() - started < 5
    _one_line_error(capsys, code, "org/missing", "not in the local Hugging Face cache", "HF_HUB_OFFLINE")
    code = _main(["run", "synthetic", "--model", "org/name@feedface", "--output", tmp_path / "o", *TINY_RUN])
    _one_line_error(capsys, code, "org/name@feedface")
    assert no_network == [] and not (tmp_path / "o").exists()


def test_without_a_network_and_not_offline_one_quick_probe_then_the_cache(hub_cache, monkeypatch, capsys, tmp_path):
    """HF_HUB_OFFLINE unset and the Hub unreachable: one connection attempt, then the local cache only."""
    from huggingface_hub import constants

    from melt_eval.modeling import loading

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setattr(loading, "_REACHABLE", {})
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    assert loading.resolve_model_dir("org/name") == hub_cache / "models--org--name" / "snapshots" / SHA
    started = time.monotonic()
    with pytest.raises(loading.UserError) as err:
        loading.resolve_model_dir("org/missing")
    assert time.monotonic() - started < 5
    assert "org/missing" in str(err.value) and "unreachable" in str(err.value) and "\n" not in str(err.value)


def test_remote_code_is_never_run(hub_cache, capsys, tmp_path):
    _snapshot(hub_cache, "org/custom", config={"model_type": "custom-arch", "auto_map": {"AutoConfig": "x.Config"}})
    code = _main(["run", "synthetic", "--model", "org/custom", "--output", tmp_path / "o", *TINY_RUN])
    _one_line_error(capsys, code, "custom-arch", "trust_remote_code", "never")


@pytest.mark.parametrize("model, revision, message", [
    ("{dir}", "main", "applies to Hub ids"),
    ("tiny-random-melt", "main", "applies to Hub models"),
    ("org/name@abc", "def", "give one"),
    ("org/name@", None, "revision after '@' is empty"),
    ("bad id/x", None, "neither an existing directory nor a Hub id"),
    ("./no/such/dir", None, "checkpoint directory './no/such/dir' does not exist"),
])
def test_model_references_are_checked_locally(tmp_path, model, revision, message, no_network):
    from melt_eval.errors import UserError
    from melt_eval.modeling.loading import parse_model_ref

    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        parse_model_ref(model.format(dir=tmp_path), revision)
    assert no_network == []


def test_run_tasks_takes_a_revision(hub_cache, tmp_path):
    from melt_eval.evaluation import RunPaths, run_tasks
    from melt_eval.generation.options import InferenceOptions, Sampling

    options = InferenceOptions(sampling=Sampling(samples=1, max_new_tokens=4))
    [result] = run_tasks("synthetic", "org/name", options, RunPaths(output=tmp_path), revision=SHA, max_problems=1,
                         progress=False)
    assert result["model"] == f"name@{SHA}" and result["finished"] is True


# --- item 2: every local check before any network, dataset or model load ---------------------------------

BAD_INPUT = [
    (["run", "aime24", "--model", "no-such-model"], ["no-such-model"]),
    (["run", "aime24", "--model", "org/missing"], ["org/missing"]),
    (["run", "aime24", "--model", "Qwen/Qwen2.5-0.5B-Instruct"], ["Qwen/Qwen2.5-0.5B-Instruct"]),
    (["run", "aime24", "--model", "./no/such/dir"], ["./no/such/dir"]),
    (["run", "aime24", "--model", "org/name@"], ["org/name@"]),
    (["run", "aime24,nosuchtask", "--model", "org/name"], ["nosuchtask"]),
    (["run", "aime24", "--model", "org/name", "--max-problems", "0"], ["--max-problems"]),
    (["run", "aime24", "--model", "org/name", "--data-dir", "/nonexistent-data-dir"], ["/nonexistent-data-dir"]),
    (["run", "aime24", "--model", "org/name", "--data-dir", "{tmp}/empty"], ["no aime24.jsonl"]),
    (["run", "aime24", "--model", "org/name", "--backend", "endpoint"], ["--base-url"]),
    (["run", "aime24", "--model", "org/name", "--base-url", "http://127.0.0.1:1"], ["--base-url"]),
    (["run", "aime24", "--model", "org/name", "--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization"]),
    (["run", "aime24", "--model", "org/name", "--output", "{tmp}/file"], ["is a file"]),
    (["score", "aime24", "--completions", "/nonexistent.jsonl"], ["/nonexistent.jsonl"]),
    (["score", "aime24", "--completions", "{tmp}/empty"], ["is a directory"]),
    (["score", "aime24", "--completions", "{tmp}/c.jsonl", "--data-dir", "/nonexistent-data-dir"],
     ["/nonexistent-data-dir"]),
    (["score", "nosuchtask", "--completions", "{tmp}/c.jsonl"], ["nosuchtask"]),
]


@pytest.mark.parametrize("args, fragments", BAD_INPUT, ids=[" ".join(a[:4]) + f" #{i}" for i, (a, _) in enumerate(BAD_INPUT)])
def test_bad_input_fails_before_any_network_call(hub_cache, tmp_path, capsys, no_network, args, fragments):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "c.jsonl").write_text('{"index": 0, "completions": ["1"]}\n')
    started = time.monotonic()
    code = _main([a.replace("{tmp}", str(tmp_path)) for a in args])
    _one_line_error(capsys, code, *fragments)
    assert no_network == [], f"network call before the error: {no_network}"
    assert time.monotonic() - started < 5
