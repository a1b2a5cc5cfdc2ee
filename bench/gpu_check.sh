#!/usr/bin/env bash
# Everything the GPU issue records, in one run on a CUDA machine with the project installed:
# the cuda-marked tests (8 pytest workers: compiling the Triton kernels dominates their time), a sweep
# of the kernels they compiled for fused bf16 products, GPU parity in bf16 for both fixture families
# (MTP) and for the dense one with its DFlash and DFlash2 drafts, for qwen4_exp (MTP),
# and the bench runs; the tests and parity read FIXTURES_DIR. Results go to ${OUT:-bench/results/gpu-check}.
#
#     bash bench/gpu_check.sh [FIXTURES_DIR]      # FIXTURES_DIR defaults to ../shared/fixtures
set -uo pipefail
export TRITON_INTERPRET=0  # the kernel tests default to the CPU interpreter (tests/kernels/conftest.py)
OUT=${OUT:-bench/results/gpu-check}
FIXTURES=$(realpath "${1:-../shared/fixtures}")
export FREETOKEN_FIXTURES="$FIXTURES"  # the tests read the same fixtures (tests/conftest.py)
mkdir -p "$OUT"
commit=${FREETOKEN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # as freetoken bench records it

export TRITON_CACHE_DIR=$(mktemp -d)  # a fresh cache: every kernel the tests compile is swept below
python3 -m pytest tests -m cuda -n 8 -q -p no:cacheprovider -rf --tb=short > "$OUT/gpu-tests.log" 2>&1
echo "# python3 -m pytest tests -m cuda -n 8 (commit $commit): exit $?" >> "$OUT/gpu-tests.log"
# A bf16 product contracted into a sum rounds once where torch rounds twice (compat_triton.mul_rn):
# the compiled kernels that have one, to be none unless a kernel means it.
ptx=$(find "$TRITON_CACHE_DIR" -name '*.ptx')
{ echo "# kernels with fma.rn.bf16 among the $(echo "$ptx" | grep -c .) compiled (commit $commit):"
  [ -n "$ptx" ] && grep -l "fma.rn.bf16" $ptx | xargs -r -n1 basename | sort | uniq -c; } > "$OUT/bf16-fma-kernels.txt"

for family in qwen35_dense qwen35_moe; do
    tmp=$(mktemp -d)
    freetoken convert "$FIXTURES/$family/hf" "$tmp/$family" > /dev/null
    freetoken parity "$tmp/$family" --device cuda --dtype bfloat16 -k 1 -k 2 -k 3 -k 4 -n 64 --json "$OUT/parity-gpu-bf16-$family.json" > "$OUT/parity-$family.log" 2>&1
    echo "# freetoken parity $family (commit $commit): exit $?" >> "$OUT/parity-$family.log"
    rm -rf "$tmp"
done
# DFlash and DFlash2: the dense fixture with each of its drafts (block size 4: k up to 3)
for draft in dflash dflash2; do
    tmp=$(mktemp -d)
    freetoken convert "$FIXTURES/qwen35_dense/hf" "$tmp/$draft" --dflash "$FIXTURES/qwen35_dense_dflash/$draft" > /dev/null
    freetoken parity "$tmp/$draft" --spec dflash --device cuda --dtype bfloat16 -k 1 -k 2 -k 3 -n 64 --json "$OUT/parity-gpu-bf16-$draft.json" > "$OUT/parity-$draft.log" 2>&1
    echo "# freetoken parity --spec dflash qwen35_dense + $draft (commit $commit): exit $?" >> "$OUT/parity-$draft.log"
    rm -rf "$tmp"
done

# qwen4_exp (Qwen3.8-Flash-Next) with its MTP head on the Triton kernels: CUDA graphs off (the default),
# then on (FREETOKEN_QWEN4_GRAPHS=1: decode, verify, commit and the MTP draft loop captured)
tmp=$(mktemp -d)
freetoken convert "$FIXTURES/qwen4_exp/hf" "$tmp/qwen4_exp" > /dev/null
freetoken parity "$tmp/qwen4_exp" --device cuda --dtype bfloat16 -k 1 -k 2 -k 3 -n 32 --json "$OUT/parity-gpu-bf16-qwen4_exp.json" > "$OUT/parity-qwen4_exp.log" 2>&1
echo "# freetoken parity qwen4_exp (commit $commit): exit $?" >> "$OUT/parity-qwen4_exp.log"
FREETOKEN_QWEN4_GRAPHS=1 freetoken parity "$tmp/qwen4_exp" --device cuda --dtype bfloat16 -k 1 -k 2 -k 3 -n 32 --json "$OUT/parity-gpu-bf16-qwen4_exp-graphs.json" > "$OUT/parity-qwen4_exp-graphs.log" 2>&1
echo "# FREETOKEN_QWEN4_GRAPHS=1 freetoken parity qwen4_exp (commit $commit): exit $?" >> "$OUT/parity-qwen4_exp-graphs.log"
rm -rf "$tmp"

# 256 new tokens: 64 verify steps at full acceptance (at 64 tokens, 16 steps moved the speedup a few
# percent between processes: logs/qwen3.5-9b-b1-oracle-k3-glue-*-af298fe.json)
freetoken bench --shape qwen3.5-9b -b 1 --spec oracle -k 3 --corrupt-rate 0 --corrupt-rate 0.3 --new-tokens 256 --out "$OUT/qwen3.5-9b-b1-oracle-k3.json"
freetoken bench --shape qwen3.5-9b -b 8 -b 64 --out "$OUT/qwen3.5-9b-b8-b64.json"
freetoken bench --shape qwen3.5-35b-a3b -b 1 --out "$OUT/qwen3.5-35b-a3b-b1.json"

# qwen3.8-flash-next (qwen4_exp), random weights, its first 8 of 48 layers (6 GDN, 2 QSA, the PLE
# layer): 45.9 GiB of bf16 weights with the bench's 16 M-row n-gram table, 50.7 GiB with the MTP head,
# which fits an H100's ~78 GiB as well as an H200's ~139 GiB with room for the pools and activations
# (--layers 16 would be 89.3 GiB: H200 only). Prompts of 4096 tokens, so QSA attends 2048 keys and the
# tail of a longer context. Eager, then with FREETOKEN_QWEN4_GRAPHS=1 (decode, verify, commit and the
# MTP draft loop in CUDA graphs); each JSON records whether graphs ran (`cuda_graphs`) and the floor
# at full depth (`floor_bytes_full_depth`).
flash_bench() {  # FREETOKEN_QWEN4_GRAPHS value, run name, bench options
    local graphs=$1 name=$2 log="$OUT/qwen3.8-flash-next-graphs$1.log"; shift 2
    local run="freetoken bench --shape qwen3.8-flash-next --layers 8 --prompt-len 4096 $*"
    FREETOKEN_QWEN4_GRAPHS=$graphs $run --out "$OUT/qwen3.8-flash-next-L8-$name-graphs$graphs.json" >> "$log" 2>&1
    echo "# FREETOKEN_QWEN4_GRAPHS=$graphs $run (commit $commit): exit $?" >> "$log"
}
for graphs in 0 1; do
    : > "$OUT/qwen3.8-flash-next-graphs$graphs.log"
    flash_bench $graphs b1-b8 -b 1 -b 8
    flash_bench $graphs b1-b8-oracle-k3 -b 1 -b 8 --spec oracle -k 3 --corrupt-rate 0 --corrupt-rate 0.3 --new-tokens 256
    flash_bench $graphs b1-mtp-k3 -b 1 --spec mtp -k 3
done
