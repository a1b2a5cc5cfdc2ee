#!/usr/bin/env bash
# The DFlash runtime on a CUDA machine with the project installed: where a DFlash-oracle step's time
# goes with the draft's CUDA graphs off and on (bench/dflash_draft_profile.py), then the speedup over
# no-spec against acceptance (`freetoken bench --spec dflash-oracle`), on the 9B shape at batch 1.
# The draft graphs' own tests are cuda-marked (bench/gpu_check.sh runs them). Results go to
# ${OUT:-bench/results/dflash-check}.
#
#     bash bench/dflash_check.sh [BANDWIDTH]      # copy bandwidth in bytes/s for the draft floor (H200: 4.25e12)
set -uo pipefail
export TRITON_INTERPRET=0
OUT=${OUT:-bench/results/dflash-check}
mkdir -p "$OUT"
bandwidth=${1:-4.25e12}
python3 bench/dflash_draft_profile.py --shape qwen3.5-9b -k 15 --bandwidth "$bandwidth" > "$OUT/dflash-draft-profile.jsonl"
freetoken bench --shape qwen3.5-9b -b 1 --spec dflash-oracle -k 15 --corrupt-rate 0 --corrupt-rate 0.1 --corrupt-rate 0.3 --new-tokens 256 --out "$OUT/qwen3.5-9b-b1-dflash-oracle-k15.json"
freetoken bench --shape qwen3.5-9b -b 8 --spec dflash-oracle -k 7 --corrupt-rate 0 --corrupt-rate 0.3 --new-tokens 128 --out "$OUT/qwen3.5-9b-b8-dflash-oracle-k7.json"
