"""Time QSA's selection and sparse attention (qwen4_exp's layer) at decode and verify, new kernels against
a baseline commit's.

For each context (default 2k, 8k, 32k keys) and row count (1: a decode step; k + 1: a verify block)
times, inside a CUDA graph of back-to-back calls over LAYERS layers' caches (so L2 holds none of them),
`qsa_select`, `qsa_attention` with the selection's blocks, and the two together, for the working
tree's kernels (qsa_select_triton, qsa_attention_triton; each `--partitions` value of
qsa_ref.PARTITION and each `--select-chunks` value of qsa_select_triton.SELECT_CHUNK) and for the same two modules as of `--baseline` (read from git into a temporary
folder). The shapes are qwen4_exp's: 4 indexer heads of 128 (rotary 64), blocks of 4 tokens, a
budget of 2048 keys; 24 query heads and 2 KV heads of 256; pages of 16 tokens, one sequence whose
block table is as wide as its context. Each record has the bytes a call must read and their time at
the measured copy bandwidth (the floor), and the new attention's largest difference from the
baseline's on the same blocks.

    python bench/qsa_speed.py [--contexts 2048 8192 32768] [-k 3] [--baseline cd33797] [--partitions 32 64] [--select-chunks 1024 4096]

Writes bench/results/qsa_speed-<commit>-<gpu>.json (command, commit, GPU, date, results).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from freetoken.bench import environment
from freetoken.kernels import qsa_attention_triton, qsa_ref, qsa_select_triton
from freetoken.kernels.batched import SeqBatch
from graph_timing import copy_bandwidth, graph_us

INDEX_HEADS, INDEX_DIM, ROTARY, RATIO, BUDGET = 4, 128, 64, 4, 2048
HEADS, KV_HEADS, HEAD_DIM, PAGE = 24, 2, 256, 16
LAYERS = 4
ROOT = Path(__file__).resolve().parents[1]
MODULES = ("qsa_select_triton", "qsa_attention_triton")


def baseline_modules(rev: str, folder: Path, source_dir: Path | None = None) -> dict:
    """The QSA kernel modules as of git revision `rev` (or, from source_dir, the files saved from it: a
    tree without git history), imported from copies in `folder`."""
    loaded = {}
    for name in MODULES:
        if source_dir is not None:
            source = (source_dir / f"{name}.py").read_text()
        else:
            source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/freetoken/kernels/{name}.py"], capture_output=True, text=True, check=True).stdout
        module_name = f"{name}_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
        path = folder / f"{module_name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded[name] = module
    return loaded


def layer_inputs(context: int, rows: int, gen: torch.Generator) -> dict:
    """One layer's caches and one sequence of `context` keys whose last `rows` are this step's rows."""
    pages = -(-context // PAGE)
    slots = pages * PAGE

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(torch.bfloat16)

    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    batch = SeqBatch((0,), (rows,), (context - rows,), (-1,), (table,), torch.device("cuda"))
    max_blocks = pages * PAGE // RATIO
    angles = torch.arange(max_blocks, device="cuda")[:, None] * RATIO * (1e4 ** -(torch.arange(ROTARY // 2, device="cuda") / (ROTARY // 2)))[None, :]
    angles = torch.cat([angles, angles], -1)[None]
    select = dict(q=rand(rows, INDEX_HEADS, INDEX_DIM), raw_keys=rand(slots, 1, INDEX_DIM), k_norm_weight=rand(INDEX_DIM, scale=0.1), eps=1e-6,
                  block_cos=angles.cos().to(torch.bfloat16), block_sin=angles.sin().to(torch.bfloat16), batch=batch, page_size=PAGE, ratio=RATIO,
                  top_blocks=BUDGET // RATIO)
    return dict(select=select, q=rand(rows, HEADS, HEAD_DIM), k_cache=rand(slots, KV_HEADS, HEAD_DIM), v_cache=rand(slots, KV_HEADS, HEAD_DIM))


def floor_bytes(context: int, rows: int) -> dict[str, int]:
    """Bytes a call must read: the raw indexer keys of the row group's blocks once; each row's K and V."""
    attended = min(context, BUDGET + RATIO - 1)
    select = context * INDEX_DIM * 2 + rows * INDEX_HEADS * INDEX_DIM * 2
    attention = rows * (attended * KV_HEADS * HEAD_DIM * 2 * 2 + HEADS * HEAD_DIM * 2)
    return {"select": select, "attention": attention, "both": select + attention}


def time_kernels(select_mod, attention_mod, layers: list[dict]) -> tuple[dict[str, float], torch.Tensor, list]:
    """Mean microseconds per layer of select, attention and both; the first layer's attention output and every layer's selection."""
    chosen = [select_mod.qsa_select(**layer["select"]) for layer in layers]
    scale = HEAD_DIM**-0.5

    def attend(layer, ids, counts):
        s = layer["select"]
        return attention_mod.qsa_attention(layer["q"], layer["k_cache"], layer["v_cache"], ids, counts, s["batch"], PAGE, RATIO, scale)

    def both(layer):
        return attend(layer, *select_mod.qsa_select(**layer["select"]))

    us = {
        "select": graph_us([lambda layer=layer: select_mod.qsa_select(**layer["select"]) for layer in layers]),
        "attention": graph_us([lambda layer=layer, c=c: attend(layer, *c) for layer, c in zip(layers, chosen)]),
        "both": graph_us([lambda layer=layer: both(layer) for layer in layers]),
    }
    return us, attend(layers[0], *chosen[0]), chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("-k", type=int, default=3, help="draft tokens: a verify block has k + 1 rows")
    ap.add_argument("--baseline", default="cd33797", help="git revision of the baseline kernels (cd33797: one attention program per (row, KV head), 31-pass select)")
    ap.add_argument("--baseline-dir", type=Path, default=None,
                    help="a folder with the baseline's qsa_select_triton.py and qsa_attention_triton.py (git show REV:src/freetoken/kernels/NAME.py), where the tree has no git history")
    ap.add_argument("--partitions", type=int, nargs="+", default=[qsa_ref.PARTITION], help="qsa_ref.PARTITION values to time")
    ap.add_argument("--select-chunks", type=int, nargs="+", default=[qsa_select_triton.SELECT_CHUNK], help="qsa_select_triton.SELECT_CHUNK values to time")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth()
    env["copy_bandwidth_bytes_per_s"] = bw
    print(json.dumps(env), flush=True)
    shipped = (qsa_ref.PARTITION, qsa_select_triton.SELECT_CHUNK)
    records = []
    with tempfile.TemporaryDirectory() as folder:
        old = baseline_modules(args.baseline, Path(folder), args.baseline_dir)
        for context in args.contexts:
            for rows in (1, args.k + 1):
                gen = torch.Generator(device="cuda").manual_seed(context + rows)
                layers = [layer_inputs(context, rows, gen) for _ in range(LAYERS)]
                floor = {name: round(b / bw * 1e6, 2) for name, b in floor_bytes(context, rows).items()}
                base_us, base_out, chosen = time_kernels(old["qsa_select_triton"], old["qsa_attention_triton"], layers)
                runs = [("baseline " + args.baseline, None, base_us, base_out, chosen)]
                for tiles in itertools.product(args.partitions, args.select_chunks):
                    qsa_ref.PARTITION, qsa_select_triton.SELECT_CHUNK = tiles
                    us, out, new_chosen = time_kernels(qsa_select_triton, qsa_attention_triton, layers)
                    runs.append(("working tree", tiles, us, out, new_chosen))
                qsa_ref.PARTITION, qsa_select_triton.SELECT_CHUNK = shipped
                for kernels, tiles, us, out, sel in runs:
                    record = {"kernels": kernels, "partition": tiles and tiles[0], "select_chunk": tiles and tiles[1], "context": context, "rows": rows,
                              "us_per_layer": {name: round(v, 2) for name, v in us.items()}, "floor_us": floor,
                              "attention_max_abs_diff_vs_baseline": float((out.float() - base_out.float()).abs().max()),
                              "same_selection_as_baseline": all(torch.equal(a[0], b[0]) for a, b in zip(sel, chosen)),
                              "shipped": tiles in (None, shipped)}
                    records.append(record)
                    print(json.dumps(record), flush=True)
    gpu = env["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    path = Path(args.out) / f"qsa_speed-{env['commit'][:7]}-{gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/qsa_speed.py " + " ".join(sys.argv[1:])
    path.write_text(json.dumps({"command": command, **env, "results": records}, indent=2) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
