#!/usr/bin/env bash
# Accuracy of the layer-gated policies by budget: SmolLM2-135M (or MODEL=gemma3-270m), NIAH + RULER-style (multikey included) at 2k/4k/8k,
# asl, asl_fullkv and fastkv at budgets 256, 512, 1024 and 2048, plus `full` -- one `kvpass compare`
# per budget, all started at once on the visible GPU(s) (a 135M model under the eager compiler is
# launch-bound, so the processes overlap). `kvpass compare` records each task's selection layer,
# which gives the distribution per task. TAU=0.9 adds one more `asl` run per budget at that threshold
# (the paper's 0.3 rarely fires on these small models: bench/probes/asl_ratios.py). Usage:
#   bash bench/calls/asl_accuracy.sh OUT_DIR        (writes OUT_DIR/<budget>/results.{json,csv} and logs)
set -u
out=${1:?output folder}
mkdir -p "$out"
common="--model ${MODEL:-smollm2-135m} --device cuda --task niah,ruler --lengths 2k,4k,8k --depths 0,0.5,1 --compiler eager"
python -m kvpass.cli compare $common --policies full --out "$out/full" > "$out/full.log" 2>&1 &
for b in 256 512 1024 2048; do
  python -m kvpass.cli compare $common --budget $b --policies asl,asl_fullkv,fastkv \
    --out "$out/b$b" > "$out/b$b.log" 2>&1 &
  if [ -n "${TAU:-}" ]; then
    python -m kvpass.cli compare $common --budget $b --policies asl --param tau=$TAU \
      --out "$out/b${b}_tau$TAU" > "$out/b${b}_tau$TAU.log" 2>&1 &
  fi
done
wait
tail -n 3 "$out"/*.log
