"""HumanEval scoring: completions run in the sandbox; hostile ones are contained and count as failures."""

from __future__ import annotations

import json

import pytest

from melt_eval.evaluation import score_completions
from melt_eval.evaluation.code import extract_code, program
from melt_eval.evaluation.sandbox import SandboxLimits, run_python

PROBLEM = {
    "prompt": 'def add(a, b):\n    """Return the sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def fenced(code: str) -> str:
    return f"Here is the function.\n```python\n{code}\n```\nDone."


def hostile_completions(canary) -> dict[str, str]:
    return {
        "correct": fenced("def add(a, b):\n    return a + b"),
        "body only": "    return a + b\n",
        "wrong": fenced("def add(a, b):\n    return a - b"),
        "infinite loop": fenced("def add(a, b):\n    while True:\n        pass"),
        "fork bomb": fenced("import os\nwhile True:\n    os.fork()\ndef add(a, b):\n    return a + b"),
        "deletes files": fenced(f"import os, shutil\nos.remove({str(canary)!r})\ndef add(a, b):\n    return a + b"),
        "opens a socket": fenced("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n"
                                 "def add(a, b):\n    return a + b"),
        "prints gigabytes": fenced("import sys\nwhile True:\n    sys.stdout.write('x' * 1000000)\n"
                                   "def add(a, b):\n    return a + b"),
        "eats memory": fenced("x = bytearray(8 << 30)\ndef add(a, b):\n    return a + b"),
    }


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("no fence") == "no fence"
    assert "def add" in program(PROBLEM, "    return a + b\n")


def test_hostile_completions_are_contained_and_fail(tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("still here")
    rows, lines = [], []
    cases = hostile_completions(canary)
    for i, (name, completion) in enumerate(cases.items()):
        rows.append({**PROBLEM, "task_id": f"HumanEval/{i}"})
        lines.append({"id": f"HumanEval/{i}", "completions": [completion]})
    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = score_completions("humaneval", tmp_path / "c.jsonl", data_dir=data)
    verdict = {name: d["completions"][0]["correct"] for name, d in zip(cases, result["details"])}
    assert verdict == {name: name in ("correct", "body only") for name in cases}
    assert result["metrics"]["accuracy"]["value"] == pytest.approx(2 / len(cases))
    assert canary.read_text() == "still here"


def test_sandbox_limits_and_output_cap():
    out = run_python("print('x' * 10_000_000)", SandboxLimits(timeout_s=10, output_bytes=100))
    assert len(out.stdout) <= 100
    slow = run_python("import time\ntime.sleep(60)", SandboxLimits(timeout_s=1))
    assert slow.status == "timeout" and slow.wall_s < 10
    ok = run_python("print(2 + 2)")
    assert ok.passed and ok.stdout.strip() == "4"


def test_writes_stay_inside_the_sandbox(tmp_path):
    """Files a program writes never reach the host: many capped files cannot fill the disk."""
    from melt_eval.evaluation.sandbox import describe

    layers = describe()
    if not layers["private_tmp"]:
        pytest.skip(f"no private mount namespace here ({layers})")
    marker = f"melt-eval-test-{tmp_path.name}"
    wrote = run_python(f"open('/tmp/{marker}', 'w').write('x')\nprint(open('/tmp/{marker}').read())")
    assert wrote.passed and wrote.stdout.strip() == "x"  # the program sees its own /tmp
    import os

    assert not os.path.exists(f"/tmp/{marker}")
    flood = run_python(f"for i in range(200):\n    open(f'/tmp/{marker}-{{i}}', 'w').write('x' * (1 << 20))")
    assert flood.status == "failed" and "No space left" in flood.stderr
    assert not any(name.startswith(marker) for name in os.listdir("/tmp"))


def test_run_on_humaneval_records_the_sandbox(tmp_path):
    from melt_eval.evaluation import run_tasks

    data = tmp_path / "data"
    data.mkdir()
    (data / "humaneval.jsonl").write_text(json.dumps({**PROBLEM, "task_id": "HumanEval/0"}) + "\n")
    [result] = run_tasks("humaneval", "tiny-random-melt", output=tmp_path / "out", data_dir=data, max_new_tokens=4,
                         progress=False)
    assert result["finished"] and set(result["metrics"]) == {"accuracy"} and result["num_problems"] == 1
    assert set(result["sandbox"]) >= {"drops_to_nobody", "network_namespace", "private_tmp"}
    [detail] = [json.loads(x) for x in (tmp_path / "out" / "tiny-random-melt" / "humaneval" / "details.jsonl").open()]
    assert detail["id"] == "HumanEval/0" and len(detail["completions"]) == 1
