"""GPQA, MMLU-Redux and HLE from local files in their Hub schemas: prompts, subsets and scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from melt_eval.evaluation import score_completions
from melt_eval.evaluation.hle import SUBSET_SIZE, select_subset
from melt_eval.evaluation.tasks import SPECS, gpqa_prompt


def _files(tmp_path, task, rows, completions):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / f"{task}-c.jsonl"
    path.write_text("".join(json.dumps({"index": i, "completions": [c]}) + "\n" for i, c in enumerate(completions)))
    return data, path


GPQA_ROW = {"Question": "Which is a noble gas?", "Correct Answer": "Neon", "Incorrect Answer 1": "Iron",
            "Incorrect Answer 2": "Oxygen", "Incorrect Answer 3": "Sodium"}


def test_gpqa_options_are_shuffled_the_same_way_every_time():
    a, b = gpqa_prompt(GPQA_ROW), gpqa_prompt(dict(GPQA_ROW))
    assert a.query == b.query and a.gold_index == b.gold_index
    assert f"{'ABCD'[a.gold_index]}) Neon" in a.query
    orders = {gpqa_prompt({**GPQA_ROW, "Question": f"Q{i}?"}).gold_index for i in range(20)}
    assert len(orders) > 1  # the gold is not always in the same place


def test_gpqa_and_mmlu_redux_letters(tmp_path):
    gold = "ABCD"[gpqa_prompt(GPQA_ROW).gold_index]
    wrong = next(x for x in "ABCD" if x != gold)
    data, path = _files(tmp_path, "gpqa", [GPQA_ROW, GPQA_ROW], [f"Answer: {gold}", f"Answer: {wrong}"])
    assert score_completions("gpqa", path, data_dir=data)["metrics"]["accuracy"]["value"] == pytest.approx(0.5)
    rows = [{"question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": 1}]
    data, path = _files(tmp_path, "mmlu_redux", rows, ["Answer: B"])
    assert score_completions("mmlu_redux", path, data_dir=data)["metrics"]["accuracy"]["value"] == 1.0


def test_hle_subset_is_fixed_text_only_and_scored_by_answer_type(tmp_path):
    rows = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1), "answer_type": "exactMatch",
             "image": "" if i % 3 else "data:image/png;base64,xx"} for i in range(500)]
    subset = select_subset(rows)
    assert len(subset) == SUBSET_SIZE and all(not r["image"] for r in subset)
    assert select_subset(list(reversed(rows))) == subset  # order of the dataset does not matter
    assert SPECS["hle"].num_problems == SUBSET_SIZE
    mc = {"id": "m", "question": "Pick B.", "answer": "B", "answer_type": "multipleChoice", "image": ""}
    data, path = _files(tmp_path, "hle", [subset[0], subset[1], mc], [])
    lines = [{"id": subset[0]["id"], "completions": [f"so... Answer: {subset[0]['answer']}"]},
             {"id": subset[1]["id"], "completions": ["Answer: 12345"]},
             {"id": "m", "completions": ["Answer: (B)"]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # the subset rule applies to a local file as well (here all three rows are kept)
    result = score_completions("hle", path, data_dir=data)
    verdict = {d["id"]: d["completions"][0]["correct"] for d in result["details"]}
    assert verdict == {subset[0]["id"]: True, subset[1]["id"]: subset[1]["answer"] == "12345", "m": True}


def test_custom_tasks_module_loads_in_lighteval_registry_without_name_conflicts(monkeypatch):
    """`--custom-tasks tasks/melt_tasks.py` through LightEval's own Registry, next to every built-in task
    (but the modules that reach the Hub or the web at import, which cannot load offline)."""
    from lighteval.tasks.registry import Registry

    networked = ("tiny_benchmarks", "mt_bench", "mix_eval")  # mix_eval: a Hub API call LightEval 0.13 makes wrongly
    load_files, load_dirs = Registry._load_from_files, Registry._load_from_subdirs
    monkeypatch.setattr(Registry, "_load_from_files", staticmethod(
        lambda files, prefix: load_files([f for f in files if f.stem not in networked], prefix)))
    monkeypatch.setattr(Registry, "_load_from_subdirs", staticmethod(
        lambda dirs: load_dirs([d for d in dirs if d.name not in networked])))
    module = Path(__file__).resolve().parents[1] / "tasks" / "melt_tasks.py"
    registry = Registry(tasks="melt_aime24,melt_gpqa,melt_hle,melt_humaneval,melt_mmlu_redux", custom_tasks=str(module))
    names = set(registry.task_to_configs)
    assert {"melt_aime24", "melt_gpqa", "melt_hle", "melt_humaneval"} <= names
    assert sum(n.startswith("melt_mmlu_redux:") for n in names) == 57
    config = registry.task_to_configs["melt_mmlu_redux:anatomy"][0]
    doc = config.prompt_function({"question": "Q?", "choices": ["a", "b", "c", "d"], "answer": 2}, "t")
    assert "about anatomy" in doc.query and doc.gold_index == 2


def test_prompts_are_built_by_lightevals_prompt_manager_with_the_chat_template():
    """The model sees LightEval's prompt: the task's instruction (HLE's answer format) and the chat template."""
    from melt_eval.evaluation.hle import hle_prompt
    from melt_eval.evaluation.lighteval_model import CompletionStore, HarnessModel
    from melt_eval.generation.backends import ReplayBackend
    from melt_eval.generation.options import InferenceOptions, Sampling
    from melt_eval.modeling.loading import load_tokenizer
    from melt_eval.modeling.loading import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir("tiny-random-melt"))
    model = HarnessModel("m", tok, ReplayBackend(), InferenceOptions(sampling=Sampling(1, 1.0, 0.7, 8, 0)),
                         CompletionStore(Path("/nonexistent")))
    doc = hle_prompt({"id": "q", "question": "What is 2+2?", "answer": "4", "answer_type": "exactMatch", "image": ""})
    text = tok.decode(model.encode(doc))
    assert "Confidence:" in text and "What is 2+2?" in text
    assert text.startswith("<|im_start|>user") and text.rstrip().endswith("<|im_start|>assistant")
