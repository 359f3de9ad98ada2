"""HumanEval: functional correctness of generated code, run in the sandbox, never in this process.

The gold "answer" LightEval carries for a problem is the JSON of its prompt, tests and entry point;
LightEval's pass@k metric calls `humaneval_score` on each completion. The completion's code runs in
`melt_eval.evaluation.sandbox` (namespaces, seccomp, rlimits); the problem's own code (the prompt's helpers
and `check`) runs in a separate trusted process, which calls `check(candidate)` where each call of
`candidate` crosses to the sandbox and back as data (builtin literals only). It passes only when `check`
returned, so an early exit, a kill, a timeout, a forged token, a frame-reading trick or an object whose
`__eq__` always says True is a failure.
"""

from __future__ import annotations

import json
import re

from lighteval.tasks.requests import Doc

from melt_eval.errors import UserError
from melt_eval.evaluation.sandbox import SandboxLimits, run_check

FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30)


def humaneval_prompt(line: dict, task_name: str | None = None) -> Doc:
    check_problem(line)
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


def candidate_code(problem: dict, completion: str) -> str:
    """What runs in the sandbox: the completion's code (a body only completes the given signature)."""
    code = extract_code(completion)
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code
    return code


def check_source(problem: dict) -> str:
    """What the trusted checker runs: the prompt's helpers (the tests call some, e.g. `poly`, `encode_cyclic`) and
    the tests. The whole prompt where it compiles alone (a signature with a docstring); a bare signature
    (`def f(x):`, valid HumanEval-format data) does not, so the entry point's own definition is left out: the
    checker binds that name to the candidate anyway."""
    prompt = problem["prompt"]
    if not _compiles(prompt):
        starts = list(re.finditer(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(problem['entry_point'])}[ \t]*\(",
                                  prompt, re.MULTILINE))
        if starts:
            prompt = prompt[: starts[-1].start()]
    return f"{prompt}\n\n{problem['test']}\n"


def _compiles(source: str) -> bool:
    try:
        compile(source, "prompt", "exec")  # compiling runs nothing
        return True
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return False


def check_problem(problem: dict) -> None:
    """A HumanEval-format row the checker can run, else a one-line UserError naming the row: the fields are
    text, the entry point a name, and the checker's source compiles. A problem whose checker cannot compile
    is a data error, never the model's failure (every completion would fail, the correct ones too)."""
    name = problem.get("task_id", "a problem")
    for key in ("prompt", "test", "entry_point"):
        if not isinstance(problem.get(key), str):
            raise UserError(f"humaneval: {name}'s {key!r} is a {type(problem.get(key)).__name__}, not text; "
                            'fix the data ({"task_id", "prompt", "test", "entry_point"} per line)')
    if not problem["entry_point"].isidentifier():
        raise UserError(f"humaneval: {name}'s entry_point {problem['entry_point']!r} is not a Python name; fix the data")
    try:
        compile(check_source(problem), "check.py", "exec")
    except (SyntaxError, ValueError) as exc:
        where = f" (line {exc.lineno} of prompt+test)" if getattr(exc, "lineno", None) else ""
        raise UserError(f"humaneval: {name}'s prompt and test do not compile as the checker's code: "
                        f"{getattr(exc, 'msg', exc)}{where}; fix the data (no completion could pass it)") from None


def program(problem: dict, completion: str) -> str:
    """Completion and tests as one program, as OpenAI's harness runs it (not used to score: see `run_check`)."""
    return f"{candidate_code(problem, completion)}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def humaneval_check(problem: dict, completion: str):
    return run_check(candidate_code(problem, completion), check_source(problem), problem["entry_point"], LIMITS)


def humaneval_score(doc: Doc, model_response) -> float:
    problem = json.loads(doc.get_golds()[0])
    return float(humaneval_check(problem, model_response.final_text[0]).passed)
