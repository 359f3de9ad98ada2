"""Issue 69 item 5: `melt-eval serve` with a port already in use, or a --host that does not resolve, is one line
and exit 2 before vLLM starts (it used to end in vLLM's traceback after ~20 s of engine start-up). vLLM is never
started here: os.execv is replaced by a recorder."""

import socket

import pytest

from melt_eval import serve
from melt_eval.cli import main


@pytest.fixture
def started(monkeypatch):
    """The command vLLM would have been started with (none while the check refuses)."""
    calls = []
    monkeypatch.setattr(serve.os, "execv", lambda path, argv: calls.append(argv))
    return calls


def run(monkeypatch, capsys, *args) -> tuple[int, str]:
    monkeypatch.setattr("sys.argv", ["melt-eval", "serve", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err.strip()


def one_line(code: int, err: str, *words: str) -> None:
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(w in err for w in words), err


@pytest.fixture
def busy():
    """A port something already listens on (all addresses, as a server)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_refused_before_vllm_starts(monkeypatch, capsys, started, busy):
    one_line(*run(monkeypatch, capsys, "tiny-random-ouro", "--port", busy), f"port {busy} is already in use",
             "--port")
    one_line(*run(monkeypatch, capsys, "tiny-random-ouro", "--host", "127.0.0.1", "--port", busy),
             f"127.0.0.1:{busy} is already in use")
    assert started == []


def test_a_port_passed_through_to_vllm_is_checked_too(monkeypatch, capsys, started, busy):
    """vLLM keeps the last --port: one given after `--` is the one it binds."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    one_line(*run(monkeypatch, capsys, "tiny-random-ouro", "--port", port, "--", f"--port={busy}"),
             f"port {busy} is already in use")
    assert started == []
    assert serve.listen_address(None, 8000, ["--uds", "/tmp/s"]) is None  # a Unix socket: nothing to check


def test_a_host_that_does_not_resolve_is_refused_before_vllm_starts(monkeypatch, capsys, started):
    one_line(*run(monkeypatch, capsys, "tiny-random-ouro", "--host", "no-such-host.invalid"),
             "--host 'no-such-host.invalid' does not resolve")
    assert started == []


def test_a_host_that_is_not_this_machine_is_refused(monkeypatch, capsys, started):
    one_line(*run(monkeypatch, capsys, "tiny-random-ouro", "--host", "192.0.2.1"),  # TEST-NET-1, nobody's address
             "--host 192.0.2.1 is not an address of this machine")
    assert started == []


def test_a_free_port_goes_on_to_vllm_and_dry_run_checks_nothing(monkeypatch, capsys, started, busy):
    """A free address passes the check (and is let go: vLLM binds it); --dry-run starts nothing, so it is not
    checked."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert run(monkeypatch, capsys, "tiny-random-ouro", "--host", "127.0.0.1", "--port", port)[0] == 0
    assert len(started) == 1 and started[0][started[0].index("--port") + 1] == str(port)
    serve.check_listen("127.0.0.1", port)  # the check left it free
    assert run(monkeypatch, capsys, "tiny-random-ouro", "--port", busy, "--dry-run")[0] == 0
    assert len(started) == 1


def test_the_model_may_be_given_as_run_gives_it(monkeypatch, capsys, started):
    """`melt-eval run` takes --model NAME, and users type it to serve too: it was read as a model named
    '--model'. An option before the model is one line that says the order."""
    for args in (["--model", "tiny-random-ouro"], ["--model=tiny-random-ouro"], ["tiny-random-ouro"]):
        monkeypatch.setattr("sys.argv", ["melt-eval", "serve", *args, "--dry-run"])
        try:
            main()
        except SystemExit as exit_:
            assert exit_.code in (0, None), capsys.readouterr().err
        out = capsys.readouterr().out
        assert "--served-model-name tiny-random-ouro" in out and "--model=" not in out, (args, out)
    one_line(*run(monkeypatch, capsys, "--bogus", "tiny-random-ouro", "--dry-run"), "--bogus: name the model first",
             "melt-eval serve MODEL [OPTIONS]")
    assert started == []
