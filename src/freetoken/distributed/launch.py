"""Run a function on N worker processes joined in one process group, and bring them all down together.

`launch(fn, world_size, *args)` spawns N workers (torch.multiprocessing, start method spawn) on
127.0.0.1 with a free port. Worker r initialises the group (gloo on CPU, NCCL on CUDA with
NCCL_NVLS_ENABLE=0 and device cuda:r), calls `fn(ParallelContext, *args)` and sends its return
value back. If any worker raises or dies, the others are terminated and the parent raises one
FreetokenError naming the rank and its error; past `timeout` seconds, all are killed. `fn` must be
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
        buf = io.BytesIO()
        torch.save(result, buf)
        results.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def rank_device(device: str, rank: int) -> str:
    """The device of rank `rank`: cuda -> cuda:rank, cpu stays cpu."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


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
    deadline = time.monotonic() + timeout
    try:
        while True:
            _drain(results, outputs)
            if procs.join(timeout=0.05):
                break
            if time.monotonic() > deadline:
                raise FreetokenError(f"tensor-parallel workers did not finish within {timeout:.0f} s; all were stopped")
    except mp.ProcessRaisedException as exc:
        raise FreetokenError(f"tensor-parallel rank {exc.error_index} failed: {_last_line(str(exc))}") from None
    except mp.ProcessExitedException as exc:
        raise FreetokenError(f"tensor-parallel rank {exc.error_index} exited with code {exc.exit_code}; all ranks were stopped") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    _drain(results, outputs, wait_for=world_size)
    return [torch.load(io.BytesIO(outputs[r]), weights_only=False) for r in range(world_size)]


def _drain(results, outputs: dict[int, bytes], wait_for: int = 0) -> None:
    """Move finished ranks' results into outputs; wait (briefly) until `wait_for` ranks have reported."""
    while True:
        try:
            rank, payload = results.get(timeout=10.0) if len(outputs) < wait_for else results.get_nowait()
        except queue.Empty:
            if len(outputs) < wait_for:
                raise FreetokenError(f"tensor-parallel workers exited but only ranks {sorted(outputs)} returned a result") from None
            return
        outputs[rank] = payload


def _last_line(traceback_text: str) -> str:
    """The exception line of a worker's traceback; a FreetokenError's message without its class."""
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown error"
    return re.sub(r"^freetoken\.errors\.\w+: ", "", last)
