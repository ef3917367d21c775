#!/usr/bin/env bash
# Accuracy of the prefill-eviction policies by budget: SmolLM2-135M, NIAH + RULER-style at 1k/2k/4k, every prefill-eviction
# policy at budgets 64, 96, 128, 256 and 1024, plus `full` -- one `kvpass compare` per budget, all
# started at once on one GPU (a 135M model under the eager compiler is launch-bound, so the
# processes overlap; on a 2-core CPU the same sweep takes hours). Usage:
#   bash bench/calls/eviction_accuracy.sh OUT_DIR        (writes OUT_DIR/<budget>/results.{json,csv} and logs)
# MODEL (default smollm2-135m), BUDGETS (default "64 96 128 256 1024") and FULL=0 (skip `full`) in the
# environment split the sweep, e.g. over the GPUs of bench/calls/lanes.sh.
set -u
out=${1:?output folder}
mkdir -p "$out"
common="--model ${MODEL:-smollm2-135m} --device cuda --task niah,ruler --lengths 1k,2k,4k --depths 0,0.5,1 --compiler eager"
if [ "${FULL:-1}" = 1 ]; then
  python -m kvpass.cli compare $common --policies full --out "$out/full" > "$out/full.log" 2>&1 &
fi
for b in ${BUDGETS:-64 96 128 256 1024}; do
  python -m kvpass.cli compare $common --budget $b --policies streamingllm,snapkv,pyramidkv,chunkkv,sablock \
    --out "$out/b$b" > "$out/b$b.log" 2>&1 &
done
wait
tail -n 3 "$out"/*.log
