"""The command line's flags (issue 38 items 4 and 5): the names LightEval and lm-evaluation-harness users know,
fixed sets as choices, help that says every default, byte sizes parsed alike, --api-key, and tables that are
never cut when written into a pipe."""

import json
import os
import subprocess
import sys
import typing

import pytest
import typer
from typer.testing import CliRunner

from melt_eval.cli import app
from melt_eval.errors import UserError

from helpers import main_exit_code as _main

_GROUP = typer.main.get_command(app)
ROOT = _GROUP.context_class(_GROUP)  # typer brings its own click: its classes, not `import click`'s
COMMANDS = _GROUP.commands


def _options(command):
    return [p for p in command.params if p.param_type_name == "option"]


def _parse(command: str, args: list[str]) -> dict:
    """The values `command` is called with for `args`, without running it."""
    return COMMANDS[command].make_context(command, list(args), parent=ROOT).params


# --- names users know ------------------------------------------------------------------------------

def test_run_takes_limit_and_output_dir(tmp_path, capsys):
    out = tmp_path / "X"
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--limit", "1", "--samples", "1",
                  "--max-new-tokens", "4", "--output-dir", out, "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0
    [results] = list(out.glob("*/synthetic/results.json"))
    assert json.loads(results.read_text())["num_problems"] == 1
    assert "tiny-random-melt" in stdout and "…" not in stdout  # the table into a pipe: nothing cut


def test_run_passes_log_samples_and_revision_through(tmp_path, capsys):
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--limit", "1", "--samples", "1",
                  "--max-new-tokens", "4", "--output", out, "--no-progress", "--log-samples"])
    assert code == 0 and len(list(out.glob("*/synthetic/samples_synthetic_*.jsonl"))) == 1
    capsys.readouterr()
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--revision", "v1", "--output", out])
    assert code == 2 and "revision" in capsys.readouterr().err  # a registry model built locally has no revisions


@pytest.mark.parametrize("command, positional", [("run", ["synthetic", "--model", "m"]), ("ablate", ["gates"])])
def test_aliases_are_the_same_options(command, positional):
    for flag in ("--max-problems", "--limit", "--max-samples"):
        assert _parse(command, [*positional, flag, "3"])["max_problems"] == 3
    for flag in ("--output", "--output-dir"):
        assert str(_parse(command, [*positional, flag, "somewhere"])["output"]) == "somewhere"


# --- choices ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, choices",
    [
        (["run", "synthetic", "--model", "m", "--backend", "bogus"], ["native", "vllm", "endpoint"]),
        (["run", "synthetic", "--model", "m", "--kv-sharing", "middle"], ["first", "last"]),
        (["run", "synthetic", "--model", "m", "--dtype", "float8"], ["auto", "bfloat16", "float16", "float32"]),
        (["serve", "m", "--kv-sharing", "middle"], ["first", "last"]),
        (["serve", "m", "--dtype", "float8"], ["auto", "bfloat16"]),
        (["score", "synthetic", "--completions", "c.jsonl", "--format", "yaml"], ["table", "json"]),
        (["tasks", "--format", "yaml"], ["table", "json"]),
        (["models", "--format", "yaml"], ["table", "json"]),
        (["claims", "d", "--format", "yaml"], ["table", "markdown", "latex", "json"]),
        (["memory", "--format", "yaml"], ["table", "json", "latex"]),
        (["memory", "--measure", "guess"], ["analytic", "vllm"]),
        (["ablate", "gates", "--preset", "huge"], ["paper", "tiny"]),
        (["ablate", "gates", "--backend", "endpoint"], ["native", "vllm"]),
    ],
)
def test_a_bad_choice_exits_2_naming_the_choices(args, choices):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert all(repr(c) in result.output for c in choices), result.output


@pytest.mark.parametrize("flag, value", [("--backend", "tpu"), ("--kv-sharing", "middle")])
def test_a_bad_choice_writes_nothing(tmp_path, capsys, flag, value):
    out = tmp_path / "out"
    code = _main(["run", "synthetic", "--model", "tiny-random-ouro", "--output", out, "--no-progress", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and f"'{value}' is not one of" in err, err
    assert not out.exists()


def test_the_choices_are_the_librarys():
    from melt_eval.cache_layout import KV_SHARING
    from melt_eval.evaluation import cli as evaluation_cli
    from melt_eval.experiments import ablations
    from melt_eval.experiments import cli as experiments_cli
    from melt_eval.generation.backends import BACKENDS
    from melt_eval import serve

    values = typing.get_args
    assert values(evaluation_cli.Backend) == BACKENDS
    assert set(values(evaluation_cli.KvSharing)) == set(values(serve.KvSharing)) == set(KV_SHARING) - {None}
    assert values(evaluation_cli.Dtype) == values(serve.Dtype)
    assert set(values(experiments_cli.Preset)) == set(ablations.PRESETS)
    assert set(values(experiments_cli.Backend)) < set(BACKENDS)


def test_choices_keep_their_spelling():
    params = _parse("run", ["synthetic", "--model", "m", "--backend", "vllm", "--kv-sharing", "last",
                            "--dtype", "bfloat16"])
    assert (params["backend"], params["kv_sharing"], params["dtype"]) == ("vllm", "last", "bfloat16")
    assert type(params["backend"]) is str


# --- help -------------------------------------------------------------------------------------------

def _every_option():
    for name, command in COMMANDS.items():
        for option in _options(command):
            yield name, option


@pytest.mark.parametrize("command, option", list(_every_option()), ids=lambda x: getattr(x, "name", x))
def test_every_option_has_help_that_states_its_default(command, option):
    assert option.help and option.help.strip(), f"{command} {option.opts[0]} has no help"
    if option.required or option.name == "help":
        return
    # typer prints "[default: X]" itself for a value; a None (or off) default is said in the help text
    if option.default is None or option.default is False:
        assert "default" in option.help.lower(), f"{command} {option.opts[0]}: help does not state its default"


def test_run_help_has_panels():
    panels = {o.rich_help_panel for o in _options(COMMANDS["run"])}
    assert {"Model", "Generation", "Evaluation", "Output", "Memory"} <= panels
    assert any(p and p.startswith("Security") for p in panels)
    result = CliRunner().invoke(app, ["run", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for panel in ("Model", "Generation", "Evaluation", "Output", "Memory", "Security"):
        assert f"─ {panel}" in result.output


# --- byte sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, positional", [("run", ["synthetic", "--model", "m"]), ("serve", ["m"])])
def test_kv_cache_bytes_takes_units(command, positional):
    assert _parse(command, [*positional, "--kv-cache-bytes", "1GiB"])["kv_cache_bytes"] == 2**30
    assert _parse(command, [*positional, "--kv-cache-bytes", "40GB"])["kv_cache_bytes"] == 40 * 10**9
    assert _parse(command, [*positional, "--kv-cache-bytes", "4096"])["kv_cache_bytes"] == 4096
    if command == "run":
        assert _parse(command, [*positional, "--max-cache-bytes", "512MiB"])["max_cache_bytes"] == 512 * 2**20


@pytest.mark.parametrize("args", [["run", "synthetic", "--model", "tiny-random-melt"], ["serve", "tiny-random-melt"]])
def test_a_bad_size_is_one_line(tmp_path, capsys, args):
    code = _main([*args, "--kv-cache-bytes", "lots"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --kv-cache-bytes 'lots' is not a size"), err


# --- --api-key ----------------------------------------------------------------------------------------

def test_api_key_reaches_the_endpoint_backend(monkeypatch):
    import melt_eval.evaluation as evaluation

    seen = {}
    monkeypatch.setattr(evaluation, "run_tasks", lambda *a, backend, **k: seen.setdefault("settings", backend) and [])
    result = CliRunner().invoke(app, ["run", "synthetic", "--model", "m", "--backend", "endpoint",
                                      "--base-url", "http://127.0.0.1:9", "--api-key", "sekrit"])
    assert result.exit_code == 0, result.output
    assert seen["settings"].api_key == "sekrit" and "sekrit" not in repr(seen["settings"])

    from melt_eval.generation.backends import EndpointBackend

    backend = EndpointBackend("http://127.0.0.1:9", tokenizer=None, api_key="sekrit")
    assert backend.endpoint._client.headers["Authorization"] == "Bearer sekrit"
    backend.close()


def test_api_key_falls_back_to_openai_api_key(monkeypatch):
    from melt_eval.generation.backends import EndpointBackend

    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    backend = EndpointBackend("http://127.0.0.1:9", tokenizer=None)
    assert backend.endpoint._client.headers["Authorization"] == "Bearer from-env"
    backend.close()


def test_api_key_needs_the_endpoint_backend(capsys):
    code = _main(["run", "synthetic", "--model", "tiny-random-melt", "--api-key", "k"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "error: --api-key goes with --backend endpoint; drop it here"


# --- output for pipes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, names", [
    (["tasks"], ["olympiadbench", "edinburgh-dawg/mmlu-redux-2.0"]),
    (["models"], ["tiny-random-melt", "ouro-1.4b-thinking"]),
    (["memory"], []),
])
def test_tables_into_a_pipe_are_never_cut(args, names):
    env = {**os.environ, "COLUMNS": "40"}  # even a narrow COLUMNS does not squeeze a pipe
    out = subprocess.run([sys.executable, "-m", "melt_eval.cli", *args], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert "…" not in out, out
    assert all(n in out for n in names), out


def test_unit_errors_name_their_flag():
    from melt_eval.units import byte_size, parse_bytes

    with pytest.raises(UserError, match="--max-cache-bytes"):
        parse_bytes("lots")
    with pytest.raises(UserError, match="^--kv-cache-bytes must be a positive size"):
        byte_size("--kv-cache-bytes")("0")
