"""A run also writes LightEval's own results and details files (and, asked, lm-evaluation-harness's samples);
details.jsonl keeps each prompt, results.json the date and git commit; `report` reads only results.json."""

from __future__ import annotations

import json
import re

import pytest

from melt_eval.evaluation import RunPaths, run_tasks
from melt_eval.generation import backends
from melt_eval.generation.options import InferenceOptions, Sampling
from melt_eval.report.results import load_results

RUN = dict(max_problems=2, progress=False)
OPTIONS = InferenceOptions(sampling=Sampling(samples=2, max_new_tokens=3))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    [result] = run_tasks("synthetic", "tiny-random-melt", OPTIONS, RunPaths(output=root), log_samples=True, **RUN)
    return result, root / "tiny-random-melt" / "synthetic"


def test_lighteval_results_file_has_its_schema(finished):
    result, task_dir = finished
    path = task_dir / result["lighteval_files"]["results"]
    assert re.fullmatch(r"results_\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d\.\d+\.json", path.name) and path.parent == task_dir
    lighteval = json.loads(path.read_text())
    assert set(lighteval) == {"config_general", "results", "versions", "config_tasks", "summary_tasks", "summary_general"}
    assert lighteval["config_general"]["model_name"] == "tiny-random-melt"
    assert lighteval["config_general"]["model_config"]["generation_parameters"]["max_new_tokens"] == 3
    scores = lighteval["results"]["synthetic|0"]
    assert scores["pass@k:k=1&n=2"] == pytest.approx(result["metrics"]["pass@1"]["value"])


def test_lighteval_details_parquet_has_the_prompts(finished):
    import pyarrow.parquet as pq

    result, task_dir = finished
    [rel] = result["lighteval_files"]["details"]
    assert rel.startswith("details/tiny-random-melt/") and rel.endswith(".parquet")
    table = pq.read_table(task_dir / rel)
    assert table.column_names == ["doc", "metric", "model_response"]  # LightEval's (sorted, no "id")
    details = [json.loads(x) for x in (task_dir / "details.jsonl").read_text().splitlines()]
    responses = table.column("model_response").to_pylist()
    assert sorted(r["input"] for r in responses) == sorted(d["prompt"] for d in details)
    assert all(len(r["text"]) == 2 for r in responses)


def test_details_jsonl_has_the_prompt_lighteval_built(finished):
    _, task_dir = finished
    details = [json.loads(x) for x in (task_dir / "details.jsonl").read_text().splitlines()]
    assert len(details) == 2
    for d in details:
        # the chat template's text around the synthetic problem (tiny-random-melt has a ChatML template)
        assert isinstance(d["prompt"], str) and "<|im_start|>user" in d["prompt"] and d["prompt"].endswith("assistant\n")


def test_results_json_has_date_and_git_state(finished):
    result, task_dir = finished
    on_disk = json.loads((task_dir / "results.json").read_text())
    assert on_disk == result
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result["date"])
    assert result["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", result["git_commit"])
    assert result["git_dirty"] in (True, False, None)


def test_samples_file_is_lm_eval_shaped(finished):
    result, task_dir = finished
    name = result["lighteval_files"]["samples"]
    assert name.startswith("samples_synthetic_") and name.endswith(".jsonl")
    lines = [json.loads(x) for x in (task_dir / name).read_text().splitlines()]
    assert [x["doc_id"] for x in lines] == [0, 1]
    for x in lines:
        assert {"doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                "doc_hash", "prompt_hash", "target_hash", "pass@1"} <= set(x)
        assert len(x["resps"][0]) == 2 and x["arguments"]["gen_args_0"]["arg_0"].startswith("<|im_start|>")


def test_no_samples_file_unless_asked(tmp_path):
    [result] = run_tasks("synthetic", "tiny-random-melt", OPTIONS, RunPaths(output=tmp_path), **RUN)
    assert "samples" not in result["lighteval_files"]
    assert not list((tmp_path / "tiny-random-melt" / "synthetic").glob("samples_*"))


def test_report_reads_only_results_json(finished):
    result, task_dir = finished
    rs = load_results(task_dir.parent.parent)
    assert [r.path for r in rs.every] == [task_dir / "results.json"]


class _Interrupt(Exception):
    pass


def test_resumed_run_writes_the_same_completions_and_details(tmp_path, monkeypatch):
    real = backends.NativeBackend.generate
    calls = []

    def failing(self, prompts, seeds, s, eos):
        calls.append(len(prompts))
        if len(calls) > 1:
            raise _Interrupt()
        return real(self, prompts, seeds, s, eos)

    monkeypatch.setattr(backends.NativeBackend, "problems_per_batch", lambda self, samples: 1)
    monkeypatch.setattr(backends.NativeBackend, "generate", failing)
    with pytest.raises(_Interrupt):
        run_tasks("synthetic", "tiny-random-melt", OPTIONS, RunPaths(output=tmp_path / "a"), **RUN)
    a = tmp_path / "a" / "tiny-random-melt" / "synthetic"
    assert not (a / "results.json").exists() and not list(a.glob("results_*.json"))
    monkeypatch.setattr(backends.NativeBackend, "generate", real)
    [resumed] = run_tasks("synthetic", "tiny-random-melt", OPTIONS, RunPaths(output=tmp_path / "a"), **RUN)
    [fresh] = run_tasks("synthetic", "tiny-random-melt", OPTIONS, RunPaths(output=tmp_path / "b"), **RUN)
    b = tmp_path / "b" / "tiny-random-melt" / "synthetic"
    for name in ("completions.jsonl", "details.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert resumed["metrics"] == fresh["metrics"]
    assert len(list(a.glob("results_*.json"))) == 1  # the finished run's; the interrupted one saved none
