"""HumanEval: functional correctness of generated code, run in the sandbox, never in this process.

The gold "answer" LightEval carries for a problem is the JSON of its prompt, tests and entry point;
LightEval's pass@k metric calls `humaneval_score` on each completion, which assembles the program
(the completion's code, the problem's tests, `check(entry_point)` last) and runs it in
`melt_eval.evaluation.sandbox` (namespaces, seccomp, rlimits). It passes only if the program ran to its
end, i.e. `check` returned: the sandbox's per-run token proves it, so an early `sys.exit(0)`/`os._exit(0)`,
a kill or a timeout is a failure, as in OpenAI's human-eval.
"""

from __future__ import annotations

import json
import re

from lighteval.tasks.requests import Doc

from melt_eval.evaluation.sandbox import SandboxLimits, run_python

FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30)


def humaneval_prompt(line: dict, task_name: str | None = None) -> Doc:
    query = (
        "Complete the following Python function. Reply with the complete function, imports included, "
        f"in a single ```python code block.\n\n```python\n{line['prompt']}```"
    )
    gold = json.dumps({"prompt": line["prompt"], "test": line["test"], "entry_point": line["entry_point"]})
    return Doc(task_name=task_name, query=query, choices=[gold], gold_index=0)


def extract_code(completion: str) -> str:
    """The last fenced code block, or the whole completion when it has none."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def program(problem: dict, completion: str) -> str:
    code = extract_code(completion)
    if f"def {problem['entry_point']}" not in code:  # a body only: complete the given signature
        code = problem["prompt"] + code
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def humaneval_score(doc: Doc, model_response) -> float:
    problem = json.loads(doc.get_golds()[0])
    return float(run_python(program(problem, model_response.final_text[0]), LIMITS).passed)
