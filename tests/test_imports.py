"""How melt_eval/ imports itself: no cycles, the protocol and the neutral helpers at the bottom, a light start.

The import graph is read from the source (ast), every import counted wherever it sits: at the top of a
module, inside a function, under `if TYPE_CHECKING`. A function-local import is still a dependency; it
only defers the failure a cycle causes. `from melt_eval.x import y` is an edge to module melt_eval.x.y
where that is a module, else to melt_eval.x; relative imports are resolved; `importlib.import_module`
with a literal name counts too, and so do the command modules that the command line loads by name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = "melt_eval"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Cycles that exist today and are being removed; each entry is the set of modules of one cycle. A cycle
# whose modules all lie in one entry is tolerated, any other cycle fails. Empty this list as they go
# (test_known_cycles_are_still_there warns when one has gone).
KNOWN_CYCLES_TO_REMOVE: list[frozenset[str]] = [
]

# The bottom layer: the paper's protocol as data, and helpers every layer may use. They import nothing
# else from melt_eval but melt_eval.errors (the protocol's modules also read one another; jsonio reads
# through melt_eval.files' check that a file is regular).
PROTOCOL = "melt_eval.protocol"
NEUTRAL = ("melt_eval.errors", "melt_eval.units", "melt_eval.progress", "melt_eval.files", "melt_eval.jsonio",
           "melt_eval.cache_layout", "melt_eval.provenance", "melt_eval.synthetic")

HEAVY = ("torch", "transformers", "lighteval", "vllm")


# ------------------------------------------------------------------ the graph


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _owner(name: str, known) -> str | None:
    """The innermost module of the package that `name` (a module or an attribute path) lies in."""
    while name not in known:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(name: str, path: Path, is_package: bool, known) -> dict[str, int]:
    """The melt_eval modules `name` imports, each with the line of its first import."""
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        target = _owner(target, known) if target.split(".")[0] == PACKAGE else None
        if target and target != name:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module, node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            add(node.args[0].value, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    known = modules()
    graph = {name: imports_of(name, path, is_package, known) for name, (path, is_package) in known.items()}
    for node in ast.walk(ast.parse(known["melt_eval.cli"][0].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMAND_MODULES" for t in node.targets):
            for item in node.value.elts:  # the command modules, loaded by name (melt_eval.cli.COMMAND_MODULES)
                graph["melt_eval.cli"].setdefault(item.value, item.lineno)
    return graph


def strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
    """Tarjan's components with more than one module (or a module importing itself), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, {}):
                        out.append(sorted(component))
    return out


def cycle_path(graph: dict[str, dict], component: list[str]) -> str:
    """One cycle through the component's first node, as `a -> b (where a imports b); b -> a (...)`."""
    members, start = set(component), component[0]
    parents: dict[str, str] = {}
    queue = [start]
    while queue:  # breadth first: the shortest way back to start
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                path.reverse()
                where = {(a, b): graph[a][b] if isinstance(graph[a][b], str) else f"line {graph[a][b]} of {a}"
                         for a, b in zip(path, path[1:] + [start])}
                hops = [f"{a} -> {b} ({w})" for (a, b), w in where.items()]
                return "; ".join(hops)
            if child in members and child not in parents and child != start:
                parents[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def package_of(module: str) -> str:
    """melt_eval.report.claims -> melt_eval.report; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


# ------------------------------------------------------------------ the tests


def test_the_graph_reads_function_local_and_relative_imports():
    graph = import_graph()
    assert "melt_eval.modeling.token_step" in graph["melt_eval.modeling.looplm"]  # imported inside functions only
    assert "melt_eval.evaluation.runner" in graph["melt_eval.evaluation"]  # importlib.import_module
    assert set(graph["melt_eval.cli"]) >= {"melt_eval.modeling.cli", "melt_eval.report.cli", "melt_eval.serve"}
    assert graph["melt_eval.report.tables"]["melt_eval.protocol.labels"] > 0  # `from pkg.mod import name`
    assert "melt_eval.serve" in graph["melt_eval.cli"]  # `from melt_eval import serve` is the module


def test_no_import_cycles():
    graph = import_graph()
    cycles = [c for c in strongly_connected(graph) if not any(set(c) <= known for known in KNOWN_CYCLES_TO_REMOVE)]
    assert not cycles, "import cycles:\n" + "\n".join(cycle_path(graph, c) for c in cycles)


def test_known_cycles_are_still_there():
    """A cycle in KNOWN_CYCLES_TO_REMOVE that has gone should leave the list, so that it cannot come back
    unnoticed. A warning, not a failure: the change that removes a cycle need not edit this file."""
    components = [set(c) for c in strongly_connected(import_graph())]
    gone = [sorted(known) for known in KNOWN_CYCLES_TO_REMOVE if not any(c & known for c in components)]
    if gone:
        warnings.warn(f"these cycles are gone: delete them from KNOWN_CYCLES_TO_REMOVE in {__file__}: {gone}")


def test_no_cycles_between_packages():
    """The areas form layers: no package imports one that (through others) imports it back."""
    graph: dict[str, dict[str, str]] = {}
    for module, targets in import_graph().items():
        for target, line in targets.items():
            if package_of(target) != package_of(module):
                graph.setdefault(package_of(module), {}).setdefault(package_of(target), f"line {line} of {module}")
                graph.setdefault(package_of(target), {})
    cycles = strongly_connected(graph)
    assert not cycles, "package cycles:\n" + "\n".join(cycle_path(graph, c) for c in cycles)


def test_protocol_and_neutral_helpers_are_the_bottom_layer():
    graph = import_graph()
    protocol = [m for m in graph if m == PROTOCOL or m.startswith(PROTOCOL + ".")]
    assert {"melt_eval.protocol.variants", "melt_eval.protocol.tasks", "melt_eval.protocol.labels"} <= set(protocol)
    bad = {m: sorted(t for t in graph[m] if t != "melt_eval.errors" and package_of(t) != PROTOCOL) for m in protocol}
    # jsonio opens files through files.check_regular_file (the one check that a file is safe to open)
    bad.update({m: sorted(t for t in graph[m] if t != "melt_eval.errors"
                          and (m, t) != ("melt_eval.jsonio", "melt_eval.files")) for m in NEUTRAL})
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"the bottom layer imports from above it: {bad}"


def test_the_protocol_is_plain_data():
    """The protocol imports the standard library only (and melt_eval.errors), so anything can read it."""
    known = modules()
    for module, (path, _) in known.items():
        if package_of(module) != PROTOCOL:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == PACKAGE, f"{module} imports {name}"


def test_the_report_and_the_experiments_read_the_protocol():
    """Variants, labels, task groups and the paper's model names are defined once, in melt_eval.protocol."""
    graph = import_graph()
    assert "melt_eval.protocol.variants" in graph["melt_eval.report.paper"]
    assert "melt_eval.protocol.variants" in graph["melt_eval.experiments.ablations"]
    assert not any(package_of(t) == "melt_eval.experiments" for m in graph if package_of(m) == "melt_eval.report"
                   for t in graph[m]), "the report imports the experiments"
    assert not any(t.startswith("melt_eval.generation") for t in graph["melt_eval.report.cli"])
    from melt_eval.evaluation import tasks
    from melt_eval.protocol.labels import BENCHMARK_LABELS
    from melt_eval.protocol.tasks import BENCHMARKS, GROUPS

    assert list(tasks.SPECS) == list(BENCHMARKS) and list(BENCHMARK_LABELS) == GROUPS["paper"]
    assert all(tasks.SPECS[n].metric_names == b.metric_names and tasks.SPECS[n].num_problems == b.num_problems
               for n, b in BENCHMARKS.items())


# ------------------------------------------------------------------ a light start

LIGHT_COMMANDS = [["--help"], ["tasks"], ["tasks", "--format", "json"], ["models", "--format", "json"]]


@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=" ".join)
def test_light_commands_load_neither_torch_nor_transformers(argv):
    code = (
        "import sys\n"
        "from melt_eval.cli import main\n"
        f"sys.argv = ['melt-eval', *{argv!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "the command printed nothing"
    assert "HEAVY []" in run.stderr, run.stderr[-3000:]


def test_the_package_imports_light_and_loads_subpackages_on_use():
    code = ("import sys, melt_eval\n"
            "assert melt_eval.units.parse_bytes('1k') == 1024 and melt_eval.protocol is sys.modules['melt_eval.protocol']\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-3000:] + run.stdout
