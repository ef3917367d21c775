#!/usr/bin/env bash
# The GPU run of the current design on one GPU (device tool kind `nvidia-h200`), from the repository root,
# with $OUT set. Each step fits one device call (the tool's 600 s per command); steps may share a call:
#   bash bench/calls/gpu_run.sh tests    every tests/gpu file (or those FILES names), one pytest run per file
#                                        (-x --tb=line; SHARD_FILES split in SHARDS runs), all at once on the
#                                        one GPU, each stopped at LIMIT (500) s
#   bash bench/calls/gpu_run.sh new      the tests/gpu cases of the per-head and new methods alone, in one pytest run
#   bash bench/calls/gpu_run.sh ragged   the ragged per-head decode kernel against the uniform one at the same
#                                        total (bench_decode_kernel.py --ragged; SCALES=1,2,4 also times the
#                                        ragged rows at 2x and 4x the kernel's split count; FLOORS=1,4 at 1 and 4
#                                        splits per head slot at least; BATCHES, CONTEXTS)
#   bash bench/calls/gpu_run.sh decode   LAYERS (8) layers, prompts of 2k then 130k (LENGTHS) through `generate`, beside the
#                                        queued step and the roofline (bench/bench_fastpath.py); about 65 s a policy
#                                        at 8 layers, so POLICIES names about 7 a call; a name may carry parameters
#                                        (expected_attention@decode_interval=64: its cuts between decode steps);
#                                        FEW=1: three prefills at the last length, not eight (kvzip at 32 layers)
#   bash bench/calls/gpu_run.sh prefill  TTFT and peak memory of POLICIES (full,kvzip) at 130k (LENGTHS), LAYERS (8) layers,
#                                        with the device kernels of one more prefill each (bench/bench_prefill.py)
#   bash bench/calls/gpu_run.sh profile  the device kernels of 8 decode steps at 130k, LAYERS (8) layers, per POLICIES
#                                        row (bench/bench_decode_step.py --profile): where a step above its roofline
#                                        spends its time
#   bash bench/calls/gpu_run.sh throughput  32 layers, 64 x 32k prompts at the 16 GiB KV cap of throughput_2026-11-27:
#                                        rows decoded together and tokens/s per policy (bench/bench_throughput.py);
#                                        a policy's Inductor compile takes about 210 s at 32 layers (PREFILL=eager
#                                        compiles the prefill without Inductor: faster, but another prefill time)
#   bash bench/calls/gpu_run.sh accuracy gemma3-270m, RULER-style tasks and NIAH at 2k-8k, the prefill methods
#                                        beside snapkv and full at budgets 64-1024 (`kvpass compare`; BUDGETS
#                                        picks fewer, each budget its own results folder)
# At most 8 files come back from a call, so the per-file logs are packed into one tgz beside a summary.
set -u
out=${OUT:?set OUT}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton, transformers as tf
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', tf.__version__)"
  git log -1 --format='commit %H %cd' 2>/dev/null  # the device's git metadata may lag the tree it was given:
  echo "tree $(bash bench/calls/tree_hash.sh)"      # the hash of the files that ran, which `tree_hash.sh` gives here too
  date -u; } > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
case "${1:?tests | new | ragged | decode | prefill | profile | throughput | accuracy}" in
tests)
  # every file at once (16 host cores; the compiles are host-bound), each under LIMIT seconds, so the step ends
  # inside the tool's 600 s; each file's result line reaches the summary as it ends
  # a file named in SHARD_FILES runs as SHARDS pytest processes over its collected cases, dealt round-robin
  # (test_gpu_slot_cache.py takes about 900 s alone); Inductor's compile pool shrinks to share the host
  logs=$(mktemp -d)
  export TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2}
  run_part() {  # name, then pytest arguments
    local name=$1; shift
    timeout -k 10 "${LIMIT:-500}" python -m pytest -v -x --tb=line -p no:cacheprovider "$@" > "$logs/$name.txt" 2>&1
    echo "$name: rc=$? $(tail -n 1 "$logs/$name.txt")" >> "$out/summary.txt"
  }
  for f in ${FILES:-$(cd tests/gpu && ls test_*.py)}; do
    if [[ " ${SHARD_FILES:-test_gpu_slot_cache.py} " == *" $f "* ]]; then
      mapfile -t ids < <(python -m pytest --collect-only -q -p no:cacheprovider "tests/gpu/$f" | grep '::')
      for ((s = 0; s < ${SHARDS:-5}; s++)); do
        part=()
        for ((i = s; i < ${#ids[@]}; i += ${SHARDS:-5})); do part+=("${ids[i]}"); done
        ((${#part[@]})) && run_part "${f%.py}.$s" "${part[@]}" &
      done
    else
      run_part "${f%.py}" "tests/gpu/$f" &
    fi
  done
  wait
  cat "$out/summary.txt"
  grep -h -E "FAILED|ERROR|Timeout|Error" "$logs"/test_*.txt | head -60 | tee "$out/failures.txt"
  tar czf "$out/gpu_tests.tgz" -C "$logs" . ;;
new)
  # the per-head and new methods alone across tests/gpu (what a time-limited `tests` step may not reach)
  timeout -k 10 "${LIMIT:-500}" python -m pytest -v --tb=line -p no:cacheprovider tests/gpu \
    -k "tova or knorm or keydiff or expected_attention or criticalkv or adakv or duoattention or kvzip" \
    > "$out/gpu_new_methods.txt" 2>&1
  tail -n 40 "$out/gpu_new_methods.txt" ;;
ragged)
  # the ragged per-head kernel against the uniform layout (about a minute)
  # (SCALES: the ragged rows' split counts as multiples of the kernel's, e.g. 1,2,4: the split for skewed heads)
  # (FLOORS: the splits per head slot at least, e.g. 1,4, with BATCHES=16,55 CONTEXTS=2048,32768: budget-sized heads)
  timeout -k 10 "${LIMIT:-300}" python bench/bench_decode_kernel.py --ragged --batches "${BATCHES:-1,16}" \
    --contexts "${CONTEXTS:-32768,131072}" --ragged-scales "${SCALES:-1}" --ragged-floors "${FLOORS:-1}" --no-sweep \
    --out "$out" > "$out/ragged.log" 2>&1
  tail -n 40 "$out/ragged.log" ;;
decode)
  # generate beside the queued step and the roofline; POLICIES picks the rows (the per-head and new methods by
  # default)
  name=l${LAYERS:-8}_${LENGTHS:-130k}; name=${name//,/_}  # a file name without commas (they may not come back)
  timeout -k 10 "${LIMIT:-480}" python bench/bench_fastpath.py --layers "${LAYERS:-8}" --lengths "${LENGTHS:-2000,130000}" \
    --policies "${POLICIES:-full,snapkv,adakv,duoattention,expected_attention,tova,kvzip}" --prefill-compiler eager \
    ${FEW:+--few-prefills} \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  tail -n 30 "$out/$name.log" ;;
prefill)
  timeout -k 10 "${LIMIT:-480}" python bench/bench_prefill.py --layers "${LAYERS:-8}" --lengths "${LENGTHS:-131072}" \
    --policies "${POLICIES:-full,kvzip}" --prefill-compiler eager --profile --out "$out/prefill.json" > "$out/prefill.log" 2>&1
  tail -n 8 "$out/prefill.log" | cut -c 1-3000 ;;
profile)
  timeout -k 10 "${LIMIT:-480}" python bench/bench_decode_step.py --layers "${LAYERS:-8}" --contexts 131072 --steps 32 \
    --configs "${POLICIES:-snapkv,h2o,expected_attention,tova}" --profile --out "$out/profile.json" > "$out/profile.log" 2>&1
  tail -n 60 "$out/profile.log" ;;
throughput)
  # the fixed memory cap of bench/results/throughput_2026-11-27 (32 layers, 64 x 32k prompts, 256 new tokens, 16 GiB
  # of KV): the per-head and new methods beside full and snapkv in one process
  timeout -k 10 "${LIMIT:-570}" python bench/bench_throughput.py --layers 32 --context 32768 --new 256 --requests 64 \
    --kv-gib 16 --workspace-gib 10 --max-waves 4 --baselines "" ${PREFILL:+--prefill-compiler "$PREFILL"} \
    --policies "${POLICIES:-full,snapkv,adakv,duoattention,expected_attention,kvzip}" \
    --out "$out/l32_throughput.json" > "$out/l32_throughput.log" 2>&1
  tail -n 20 "$out/l32_throughput.log" ;;
accuracy)
  # the newer prefill methods (adakv, expected_attention, criticalkv, knorm, keydiff, tova, kvzip) beside snapkv;
  # full once (no budget)
  # (the eager compiler: the scores do not depend on it, and eight Inductor compiles would take the call's time)
  python -m kvpass.cli compare --model gemma3-270m --task ruler,niah --lengths 2k,4k,8k --limit 3 --policies full \
    --compiler eager --out "$out/full" > "$out/full.log" 2>&1
  for b in ${BUDGETS:-64 256 1024}; do
    timeout -k 10 "${LIMIT:-500}" python -m kvpass.cli compare --model gemma3-270m --task ruler,niah --lengths 2k,4k,8k \
      --limit 3 --budget "$b" --compiler eager \
      --policies snapkv,adakv,expected_attention,criticalkv,knorm,keydiff,tova,kvzip \
      --out "$out/b$b" > "$out/b$b.log" 2>&1
    tail -n 12 "$out/b$b.log"
  done ;;
esac
