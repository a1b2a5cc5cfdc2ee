"""Run a function on N worker processes joined in one process group, and bring them all down together.

`launch(fn, world_size, *args)` spawns N workers (torch.multiprocessing, start method spawn) on
127.0.0.1 with a free port. Worker r initialises the group (gloo on CPU, NCCL on CUDA with
NCCL_NVLS_ENABLE=0 and device cuda:r), calls `fn(ParallelContext, *args)` and sends its return
value back. If any worker raises or dies, the others are terminated and the parent raises one
FreetokenError naming the rank that failed first and its error (the others' errors are usually
just the broken connection to it); past `timeout` seconds, all are killed. `fn` must be
importable by name (a module-level function) and its result picklable.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import queue
import re
import socket
import time
from typing import Any, Callable

import torch

from freetoken.distributed.context import ParallelContext
from freetoken.errors import FreetokenError

DEFAULT_TIMEOUT_S = 3600.0
COLLECTIVE_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _worker(rank: int, fn: Callable, world_size: int, port: int, device: str, results, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(ParallelContext(rank, world_size), *args)
    except Exception as exc:
        results.put(("error", rank, time.time(), _describe(exc)))
        raise
    finally:
        dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(result, buf)
    results.put(("ok", rank, buf.getvalue()))


def _describe(exc: BaseException) -> str:
    """One line: a FreetokenError's own message, otherwise the exception type and its first line."""
    from freetoken.errors import FreetokenError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, FreetokenError) else f"{type(exc).__name__}: {text}"


def launch(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """fn(ParallelContext, *args) on `world_size` processes -> their return values in rank order."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise FreetokenError(f"--tensor-parallel must be >= 1, not {world_size}")
    if device.startswith("cuda") and torch.cuda.device_count() < world_size:
        raise FreetokenError(f"--tensor-parallel {world_size} needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report the failure ourselves
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_worker, args=(fn, world_size, free_port(), device, results, args), nprocs=world_size, join=False, start_method="spawn")
    outputs: dict[int, bytes] = {}
    errors: list[tuple[float, int, str]] = []  # (when, rank, what)
    deadline = time.monotonic() + timeout
    try:
        while True:
            _drain(results, outputs, errors)
            if procs.join(timeout=0.05, grace_period=2.0):
                break
            if time.monotonic() > deadline:
                raise FreetokenError(f"tensor-parallel workers did not finish within {timeout:.0f} s; all were stopped")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        _drain(results, outputs, errors, settle=1.0)
        if errors:
            _, rank, what = min(errors)
            raise FreetokenError(f"tensor-parallel rank {rank} failed: {what}") from None
        if isinstance(exc, mp.ProcessRaisedException):
            raise FreetokenError(f"tensor-parallel rank {exc.error_index} failed: {_last_line(str(exc))}") from None
        raise FreetokenError(f"tensor-parallel rank {exc.error_index} exited with code {exc.exit_code}; all ranks were stopped") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    _drain(results, outputs, errors, wait_for=world_size)
    return [torch.load(io.BytesIO(outputs[r]), weights_only=False) for r in range(world_size)]


def _drain(results, outputs: dict[int, bytes], errors: list, wait_for: int = 0, settle: float = 0.0) -> None:
    """Move reported results into outputs and errors; wait until `wait_for` ranks have returned,
    or, with `settle`, until nothing more arrives for that many seconds."""
    while True:
        try:
            if len(outputs) < wait_for:
                message = results.get(timeout=10.0)
            else:
                message = results.get(timeout=settle) if settle else results.get_nowait()
        except queue.Empty:
            if len(outputs) < wait_for:
                raise FreetokenError(f"tensor-parallel workers exited but only ranks {sorted(outputs)} returned a result") from None
            return
        if message[0] == "ok":
            outputs[message[1]] = message[2]
        else:
            errors.append((message[2], message[1], message[3]))


def _last_line(traceback_text: str) -> str:
    """The exception line of a worker's traceback; a FreetokenError's message without its class."""
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown error"
    return re.sub(r"^freetoken\.errors\.\w+: ", "", last)
