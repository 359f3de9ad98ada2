"""Functions in melt_eval/training/ stay short enough to read whole (issue 37): none spans more than 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
TRAINING = Path(__file__).resolve().parents[1] / "melt_eval" / "training"


def function_spans(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from `def` (or its first decorator) to the last line) for every function in the file."""
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                spans.append((name, child.end_lineno - first + 1))
            visit(child, f"{name}." if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return spans


def test_no_training_function_is_over_80_lines():
    files = sorted(TRAINING.glob("*.py"))
    assert files, TRAINING
    long = [f"{path.name}:{name} ({n} lines)" for path in files for name, n in function_spans(path) if n > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_the_check_sees_long_functions(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    path = tmp_path / "m.py"
    path.write_text(f"class C:\n    @staticmethod\n    async def f():\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    assert function_spans(path) == [("C.f", MAX_LINES + 2)]
