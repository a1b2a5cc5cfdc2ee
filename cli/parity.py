"""`freetoken parity [MODEL] --spec mtp`: greedy with vs without speculative decoding, token by token.

Exits 1 on any mismatch and shows the first divergence. Meant for CI. With `--tensor-parallel N`
both runs use N processes (the same parallel degree); rank 0 reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from freetoken.cli._options import DeviceOpt, DType, DTypeOpt, MaxNewTokensOpt, ModelArg, PromptOpt, PromptsFileOpt, Spec, TensorParallelOpt, ThreadsOpt, console
from freetoken.cli.generate import DEFAULT_PROMPTS, run_parallel

PARITY_PROMPTS = DEFAULT_PROMPTS + [
    "import json", "for i in range(10):", "    return self", "def main():\n    args = parse_args()",
    "class Node:", "from collections import defaultdict\n\n", "if __name__ == '__main__':", "x = [",
]


def parity(
    model: ModelArg = None,
    spec: Annotated[Spec, typer.Option("--spec", help="Speculative decoding method to check.")] = Spec.mtp,
    prompt: PromptOpt = None,
    prompts: PromptsFileOpt = None,
    max_new_tokens: MaxNewTokensOpt = 64,
    num_draft_tokens: Annotated[list[int], typer.Option("--num-draft-tokens", "-k", min=1, help="k values to check (repeatable).")] = [3],  # noqa: B006
    dtype: DTypeOpt = DType.float32,
    device: DeviceOpt = "cpu",
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 16,
    against: Annotated[str, typer.Option("--against", help="'none' (spec vs no-spec) or 'hf' (greedy vs transformers).")] = "none",
    json_report: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON here.")] = None,
    threads: ThreadsOpt = 1,
    tensor_parallel: TensorParallelOpt = 1,
) -> None:
    """Check that speculative decoding leaves greedy outputs unchanged."""
    from freetoken.cli.prompts import read_prompts
    from freetoken.engine.config import EngineConfig
    from freetoken.errors import FreetokenError

    texts = read_prompts(prompt, prompts, default=PARITY_PROMPTS)
    if spec is Spec.none and against != "hf":
        raise FreetokenError("parity needs a spec method (--spec mtp or dflash) or --against hf")
    if against not in ("none", "hf"):
        raise FreetokenError(f"--against must be 'none' or 'hf', not {against!r}")
    if against == "hf" and tensor_parallel > 1:
        raise FreetokenError("--against hf runs transformers in one process; drop --tensor-parallel")
    config = EngineConfig(device=device, dtype=dtype.value, max_num_seqs=batch_size, spec=spec.value, num_draft_tokens=max(num_draft_tokens),
                          max_model_len=8192, tensor_parallel=tensor_parallel)
    job = ParityJob(model, texts, config, spec.value, tuple(num_draft_tokens), max_new_tokens, against, json_report, threads)
    if not run_parallel(run_job, job)[0]:
        raise typer.Exit(1)


@dataclass(frozen=True)
class ParityJob:
    model: str | None
    texts: list[str]
    config: Any  # EngineConfig
    spec: str
    num_draft_tokens: tuple[int, ...]
    max_new_tokens: int
    against: str
    json_report: Path | None
    threads: int


def run_job(parallel, job: ParityJob) -> bool:
    """One rank's share of `freetoken parity` -> whether every run passed; rank 0 reports."""
    import torch

    from freetoken.llm import LLM

    torch.set_num_threads(job.threads)
    llm = LLM(job.model, job.config, parallel=parallel)
    ids = [llm.encode(t) for t in job.texts]
    results = []
    if job.against == "hf":
        from freetoken.parity_hf import compare_with_hf

        results.append(("hf", compare_with_hf(llm, ids, job.max_new_tokens)))
    else:
        from freetoken.parity import compare_greedy

        for k in job.num_draft_tokens:
            results.append((f"k={k}", compare_greedy(llm, ids, job.max_new_tokens, k, job.spec)))
    if parallel.rank == 0:
        print_report(results, job)
    return all(r.passed for _, r in results)


def print_report(results: list, job: ParityJob) -> None:
    from rich.table import Table

    texts, config = job.texts, job.config
    tp = f", tensor-parallel {config.tensor_parallel}" if config.tensor_parallel > 1 else ""
    table = Table(title=f"freetoken parity ({config.dtype}, {config.device}{tp})")
    for col in ("run", "prompts", "tokens", "identical", "accept/pos", "mean accepted len", "result"):
        table.add_column(col)
    for name, report in results:
        table.add_row(
            name, str(report.num_prompts), str(report.num_tokens),
            f"{sum(report.per_prompt_match)}/{report.num_prompts}",
            " ".join(f"{a:.2f}" for a in report.acceptance_per_position) or "-",
            f"{report.mean_accepted_len:.2f}", "[green]PASS[/]" if report.passed else "[red]FAIL[/]",
        )
    console.print(table)
    failed = [(name, r) for name, r in results if not r.passed]
    for name, report in failed:
        d = report.first_divergence
        margin = f"{d.top2_margin:.3g}" if d.top2_margin is not None else "n/a"
        console.print(
            f"[red]{name}: first divergence[/] prompt {d.prompt_index} ({texts[d.prompt_index][:40]!r}), "
            f"generated position {d.position}: expected token {d.expected}, got {d.actual}; target top-2 logit margin {margin}"
        )
    if job.json_report is not None:
        _write_json(job.json_report, results, job)


def _write_json(path: Path, results: list, job: ParityJob) -> None:
    """The report with what produced it (command, commit, GPU, date), each run under its name in `runs`."""
    import sys

    from freetoken.bench import environment

    config = job.config
    record = {"command": "freetoken " + " ".join(sys.argv[1:]), **environment(), "model": job.model or "(the embedded default)", "dtype": config.dtype,
              "device": config.device, "tensor_parallel": config.tensor_parallel, "runs": {name: r.to_dict() for name, r in results}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
