"""`freetoken bench --shape qwen3.5-9b`: decode speed of a random-weight model of a real shape."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from freetoken.cli._options import DeviceOpt, DType, DTypeOpt, Spec, console


def bench(
    shape: Annotated[str, typer.Option("--shape", help="qwen3.5-9b | qwen3.5-35b-a3b")] = "qwen3.5-9b",
    batch_size: Annotated[list[int], typer.Option("--batch-size", "-b", min=1, help="Batch sizes (repeatable).")] = [1],  # noqa: B006
    prompt_len: Annotated[int, typer.Option("--prompt-len", min=1)] = 512,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1)] = 64,
    spec: Annotated[Spec, typer.Option("--spec")] = Spec.none,
    num_draft_tokens: Annotated[int, typer.Option("--num-draft-tokens", "-k", min=0)] = 0,
    device: DeviceOpt = "cuda",
    dtype: DTypeOpt = DType.bfloat16,
    out: Annotated[Optional[Path], typer.Option("--out", help="JSON results file (default bench/results/<shape>-<spec>.json).")] = None,
) -> None:
    """Benchmark decode on a random-weight model of a real shape; reports the bandwidth floor."""
    from rich.table import Table

    from freetoken.bench import SHAPES, run_bench, write_results
    from freetoken.errors import FreetokenError

    if shape not in SHAPES:
        raise FreetokenError(f"unknown --shape {shape!r} (choose from {', '.join(SHAPES)})")
    results = [
        run_bench(shape, batch_size=b, prompt_len=prompt_len, new_tokens=new_tokens, spec=spec.value, num_draft_tokens=num_draft_tokens,
                  device=device, dtype=dtype.value)
        for b in batch_size
    ]
    table = Table(title=f"freetoken bench {shape} ({dtype.value}, {device})")
    for col in ("batch", "spec", "decode tok/s", "step ms", "floor step ms", "floor tok/s", "fraction of floor", "prefill s"):
        table.add_column(col)
    for r in results:
        table.add_row(str(r.batch_size), f"{r.spec} k={r.num_draft_tokens}", f"{r.decode_tokens_per_s:.1f}", f"{r.step_ms:.2f}",
                      f"{r.floor_step_ms:.2f}", f"{r.floor_tokens_per_s:.0f}", f"{r.fraction_of_floor:.1%}", f"{r.prefill_seconds:.2f}")
    console.print(table)
    path = out or Path("bench/results") / f"{shape}-{spec.value}.json"
    write_results(path, "freetoken " + " ".join(sys.argv[1:]), results)
    console.print(f"wrote {path}")
