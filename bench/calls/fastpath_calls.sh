#!/usr/bin/env bash
# GPU calls of kvpass.compile's fast path (bench/bench_fastpath.py and its GPU tests), 2026-11-27 to 2026-11-28:
# `bash bench/calls/fastpath_calls.sh CASE` with $OUT set (A, B, C on one H100 each; the rest as noted).
# A: GPU tests of the decoding loop; 32 layers, prefill without Inductor: a first process, then a second one on
#    its Inductor caches (TORCH_LOGS=recompiles says which guard a second decode graph failed, if any).
# B: 8 layers at 33k and 130k, prefill without Inductor, the policies side by side (TPOT: kvpass's loop, HF's
#    loop, the step queued; TTFT and peaks), then `full` with an Inductor prefill for the TTFT it buys.
# C: 32 layers, full, up to 130k, prefill without Inductor: a first process and a second one on its caches.
# X (2026-11-28, 4 GPUs): the shared-layer compile against inline layers (32 layers; 8 layers at 130k) beside half
#    of tests/gpu (4-GPU machines were not lent; X0 + X1 ran as two lanes: `bash bench/calls/lanes.sh $OUT 520 'OUT=$LANE bash
#    bench/calls/fastpath_calls.sh X0' 'OUT=$LANE bash bench/calls/fastpath_calls.sh X1'`). Z, Z2, Z3 (two GPUs
#    each): the shared-layer fixes and AOT's time (probe_compile.py), then the rest of tests/gpu.
# T (2026-11-27): the GPU tests of the per-row counters (raas_stamp kernel), h2o's scoring kernel, the
#    decoding loop and admission, verbose so that a cut run still says what passed.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "$1" in
A)
  timeout 170 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py \
      -k "decode_loop or (compile_once and (full or quest or h2o))" > "$OUT/gpu_tests_A.txt" 2>&1; tail -3 "$OUT/gpu_tests_A.txt"
  export TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-A
  timeout 250 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies full,snapkv \
      --prefill-compiler eager --out "$OUT/l32_process1.json" > "$OUT/l32_process1.log" 2>&1; tail -2 "$OUT/l32_process1.log"
  TORCH_LOGS=recompiles timeout 140 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies full \
      --prefill-compiler eager --out "$OUT/l32_process2.json" > "$OUT/l32_process2.log" 2>&1; tail -2 "$OUT/l32_process2.log"
  ;;
B)
  timeout 60 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py -k decode_loop \
      > "$OUT/gpu_tests_B.txt" 2>&1; tail -3 "$OUT/gpu_tests_B.txt"
  timeout 290 python bench/bench_fastpath.py --layers 8 --lengths 2000,33000,130000 \
      --policies full,quest,snapkv,streamingllm,raas --prefill-compiler eager --out "$OUT/l8_130k.json" > "$OUT/l8_130k.log" 2>&1
  timeout 125 python bench/bench_fastpath.py --layers 8 --lengths 2000,33000 \
      --policies full,quest,snapkv,streamingllm --prefill-compiler eager --out "$OUT/l8_33k.json" > "$OUT/l8_33k.log" 2>&1
  timeout 100 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies full \
      --out "$OUT/l8_130k_inductor_prefill.json" > "$OUT/l8_130k_inductor_prefill.log" 2>&1
  ;;
C)
  timeout 100 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py tests/gpu/test_gpu_art.py \
      -k "decode_loop or full_read or horizon" > "$OUT/gpu_tests_C.txt" 2>&1; tail -3 "$OUT/gpu_tests_C.txt"
  export TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-C
  for p in 1 2; do
    TORCH_LOGS=recompiles timeout 230 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000,130000 --policies full \
        --prefill-compiler eager --out "$OUT/l32_process$p.json" > "$OUT/l32_process$p.log" 2>&1
  done
  ;;
Q)   # the request queue on the GPU: admission tests, then the throughput benchmark (8 layers, a reduced queue)
  timeout 150 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_admission.py tests/gpu/test_gpu_eviction.py \
      -k "(queue and (full or snapkv or quest or raas or h2o)) or accumulated" > "$OUT/gpu_tests_Q.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_Q.txt" | tail -20
  timeout 400 python bench/bench_throughput.py --layers 8 --context 32768 --new 256 --requests 16 --kv-gib 4 \
      --policies full,snapkv,raas --baselines hf_static,hf_continuous \
      --out "$OUT/throughput_long_context_1.json" > "$OUT/throughput_long_context_1.log" 2>&1
  ;;
T)
  timeout 570 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_slot_cache.py \
      tests/gpu/test_gpu_eviction.py $(ls tests/gpu/test_gpu_admission.py 2>/dev/null) > "$OUT/gpu_tests_T.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_T.txt" | tail -60
  ;;
E)   # 2026-11-27 (GPU 0 of two): the GPU tests the operator registry's lazy import broke, then TPOT rows
  timeout 80 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_eviction.py -k "attention_lse or accumulated" \
      > "$OUT/gpu_tests_E1.txt" 2>&1
  timeout 120 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_art.py \
      > "$OUT/gpu_tests_E2.txt" 2>&1
  grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT"/gpu_tests_E*.txt | tail -40
  timeout 340 python bench/bench_fastpath.py --layers 8 --lengths 2000,33000,130000 \
      --policies full,snapkv,streamingllm,raas --prefill-compiler eager --out "$OUT/l8_E.json" > "$OUT/l8_E.log" 2>&1
  ;;
F)   # 2026-11-27: the TPOT rows of the other policies (8 layers, 130k, beside full)
  timeout 500 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 \
      --policies full,h2o,pyramidkv,asl,art --prefill-compiler eager --out "$OUT/l8_F.json" > "$OUT/l8_F.log" 2>&1
  ;;
G)   # 2026-11-27 (GPU 1 beside F): the GPU tests E's run cut (raas from raas+art on, art), asl after gate.py's split
  timeout 300 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_art.py \
      tests/gpu/test_gpu_asl.py -k "not (page_scores or page_bounds or top_pages or raas_stamp)" \
      > "$OUT/gpu_tests_G.txt" 2>&1
  grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_G.txt" | tail -40
  timeout 150 python bench/probes/tune_accumulated.py --out "$OUT/tune_accumulated.json" > "$OUT/tune_accumulated.log" 2>&1
  ;;
H)   # 2026-11-27, later (GPU 0): the GPU tests fixed after E-G (quest's pager, layer_scores' total, attention_lse
     # through its CUDA kernel), each file in its own run so a failure keeps its text; pyramidkv's second decode
     # graph at 130k with the recompile reason; the tile sweep for the diagonal-masking kernel
  for f in "test_gpu_raas.py -k quest" "test_gpu_asl.py -k layer_scores" "test_gpu_eviction.py -k attention_lse"; do
    timeout 100 python -m pytest -q -p no:cacheprovider --tb=short tests/gpu/$f >> "$OUT/gpu_tests_H.txt" 2>&1
  done
  grep -E "passed|failed|^E " "$OUT/gpu_tests_H.txt" | tail -20
  TORCH_LOGS=recompiles timeout 180 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies pyramidkv \
      --prefill-compiler eager --out "$OUT/l8_H_pyramidkv.json" > "$OUT/l8_H_pyramidkv.log" 2>&1
  grep -A6 "Recompiling" "$OUT/l8_H_pyramidkv.log" | head -30
  timeout 150 python bench/probes/tune_accumulated.py --out "$OUT/tune_accumulated.json" > "$OUT/tune_accumulated.log" 2>&1
  ;;
I)   # 2026-11-27 (GPU 1 beside H): where a decode step's host time goes, 8 layers (bench/probes/probe_host.py):
     # at 130k the policies whose generate TPOT missed 1.15x the queued step or full's, at 2k the host-bound case
  timeout 380 python bench/probes/probe_host.py --layers 8 --length 130000 --policies full,art,snapkv,asl,raas \
      --out "$OUT/host_l8_130k.json" > "$OUT/host_l8_130k.log" 2>&1; grep "^{" "$OUT/host_l8_130k.log"
  timeout 150 python bench/probes/probe_host.py --layers 8 --length 2000 --policies full,snapkv \
      --out "$OUT/host_l8_2k.json" > "$OUT/host_l8_2k.log" 2>&1; grep "^{" "$OUT/host_l8_2k.log"
  ;;
J)   # 2026-11-27, GPU 0: the GPU tests of the changed SlotCache read; TPOT off the step clock (bench_fastpath's
     # StepClock, the 4*new cache built first), 8 layers, at 130k then at 33k (each process has its own full)
  timeout 70 python -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_gpu_slot_cache.py \
      -k "decode_loop or (compile_once and (full or pyramidkv))" > "$OUT/gpu_tests_J.txt" 2>&1; tail -3 "$OUT/gpu_tests_J.txt"
  timeout 300 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies full,snapkv,streamingllm,raas,quest \
      --prefill-compiler eager --out "$OUT/l8_J_130k.json" > "$OUT/l8_J_130k.log" 2>&1
  timeout 150 python bench/bench_fastpath.py --layers 8 --lengths 2000,33000 --policies full,snapkv,raas \
      --prefill-compiler eager --out "$OUT/l8_J_33k.json" > "$OUT/l8_J_33k.log" 2>&1
  ;;
K)   # 2026-11-27, GPU 1 beside J: the other policies the same way; pyramidkv with the recompile log
  TORCH_LOGS=recompiles timeout 330 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 \
      --policies full,h2o,pyramidkv,asl,art --prefill-compiler eager --out "$OUT/l8_K_130k.json" > "$OUT/l8_K_130k.log" 2>&1
  timeout 170 python bench/bench_fastpath.py --layers 8 --lengths 2000,33000 --policies full,pyramidkv,art \
      --prefill-compiler eager --out "$OUT/l8_K_33k.json" > "$OUT/l8_K_33k.log" 2>&1
  ;;
L)   # 2026-11-27, GPU 0: the GPU tests of the changed SlotCache read and slot rewrite (J's cut at 70 s); pyramidkv and
     # the policies J/K left above 1.15x at 130k, with the recompile log
  timeout 240 python -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_gpu_slot_cache.py \
      -k "decode_loop or compile_once" > "$OUT/gpu_tests_L.txt" 2>&1; tail -3 "$OUT/gpu_tests_L.txt"
  TORCH_LOGS=recompiles timeout 200 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 \
      --policies pyramidkv,streamingllm --prefill-compiler eager --out "$OUT/l8_L_130k.json" > "$OUT/l8_L_130k.log" 2>&1
  grep -h "0/1:\|0/2:" "$OUT/l8_L_130k.log" | cut -c1-300 | head -6
  ;;
M)   # 2026-11-27, GPU 1 beside L: host time per step by part of the decoding loop (probe_host.py), 8 layers at
     # 33k, the policies whose TPOT missed; then 32 layers, full and snapkv, TPOT at 33k
  timeout 230 python bench/probes/probe_host.py --layers 8 --length 33000 --policies full,snapkv,streamingllm,h2o \
      --out "$OUT/host_M_l8_33k.json" > "$OUT/host_M_l8_33k.log" 2>&1; grep "^{" "$OUT/host_M_l8_33k.log"
  timeout 290 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies full,snapkv \
      --prefill-compiler eager --out "$OUT/l32_M_33k.json" > "$OUT/l32_M_33k.log" 2>&1
  ;;
N)   # 2026-11-27/28, GPU 0: the whole SlotCache GPU file after J-M's read and rewrite changes (J and L were cut
     # by their timeouts), verbose so a cut run still lists what passed; then 32 layers at 128k, full and snapkv
  timeout 330 python -m pytest -v -p no:cacheprovider --tb=short tests/gpu/test_gpu_slot_cache.py \
      > "$OUT/gpu_tests_N.txt" 2>&1; grep -cE "PASSED" "$OUT/gpu_tests_N.txt"; grep -E "FAILED|ERROR" "$OUT/gpu_tests_N.txt" | head
  timeout 230 python bench/bench_fastpath.py --layers 32 --lengths 2000,130000 --policies full,snapkv \
      --prefill-compiler eager --out "$OUT/l32_N_130k.json" > /dev/null 2>&1
  ;;
O)   # 2026-11-27/28, GPU 1 beside N: the 32-layer compile, a first process and a second one on its caches
  export TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-O
  for p in 1 2; do
    TORCH_LOGS=recompiles timeout 230 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies full \
        --prefill-compiler eager --out "$OUT/l32_O_process$p.json" > "$OUT/l32_O_process$p.log" 2>&1
  done
  ;;
P)   # 2026-11-28, GPU 0: the decoding loop's GPU test after its per-step device work was cut (one token buffer,
     # the max-length rule on the host, two reused pinned flags), then compile-once (N's run was cut before both)
  F=tests/gpu/test_gpu_slot_cache.py
  timeout 540 python -m pytest -v -p no:cacheprovider --tb=short "$F::test_decode_loop_equals_hf_loop_under_cuda_graphs" \
      "$F::test_compile_once_for_every_prompt_length" > "$OUT/gpu_tests_P.txt" 2>&1
  grep -cE "PASSED" "$OUT/gpu_tests_P.txt"; grep -E "FAILED|ERROR" "$OUT/gpu_tests_P.txt" | head
  ;;
R)   # 2026-11-28, GPU 0: the replay tests N's run did not reach (Q's first form never ran: a second "Q)" case)
  F=tests/gpu/test_gpu_slot_cache.py::test_cuda_graph_replay_equals_eager_kvpass
  timeout 390 python -m pytest -v -p no:cacheprovider --tb=short "$F[snapkv+quest]" "$F[raas]" "$F[raas+art]" "$F[asl]" \
      "$F[fastkv]" "$F[asl_2pass]" "$F[gemfilter]" "$F[h2o]" "$F[h2o+art]" \
      tests/gpu/test_gpu_slot_cache.py::test_sliding_layers_cuda_graph_replay > "$OUT/gpu_tests_R.txt" 2>&1
  grep -cE "PASSED" "$OUT/gpu_tests_R.txt"; grep -E "FAILED|ERROR" "$OUT/gpu_tests_R.txt" | head
  ;;
S)   # 2026-11-28, GPU 1 beside R: host time per step after the loop's cut, 8 layers at 33k (the short steps that missed
     # 1.15x); what Dynamo's guards cost a step at 2k (probe_guards.py)
  timeout 220 python bench/probes/probe_host.py --layers 8 --length 33000 --policies full,streamingllm,h2o \
      --out "$OUT/host_S_l8_33k.json" > "$OUT/host_S_l8_33k.log" 2>&1; grep "^{" "$OUT/host_S_l8_33k.log"
  timeout 160 python bench/probes/probe_guards.py --layers 8 --length 2000 --policies full,streamingllm \
      --out "$OUT/guards_S_l8_2k.json" > "$OUT/guards_S.log" 2>&1; grep "^{" "$OUT/guards_S.log"
  ;;
U)   # 2026-11-28, GPU 0: the decoding loop's GPU tests after the mask reuse that followed S (P ran before it), then
     # 8 layers at 130k, the policies whose short steps missed 1.15x (TPOT off the step clock, beside full)
  F=tests/gpu/test_gpu_slot_cache.py
  timeout 360 python -m pytest -v -p no:cacheprovider --tb=short "$F::test_decode_loop_equals_hf_loop_under_cuda_graphs" \
      "$F::test_compile_once_for_every_prompt_length" > "$OUT/gpu_tests_U.txt" 2>&1
  grep -cE "PASSED" "$OUT/gpu_tests_U.txt"; grep -E "FAILED|ERROR" "$OUT/gpu_tests_U.txt" | head
  timeout 220 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies full,streamingllm,h2o,pyramidkv \
      --prefill-compiler eager --out "$OUT/l8_U_130k.json" > "$OUT/l8_U_130k.log" 2>&1
  ;;
V)   # 2026-11-28, GPU 1 beside U: host time per step with the mask reused (prepare_inputs was 0.52-0.58 ms in S),
     # 8 layers at 33k; then the other policies at 130k
  timeout 220 python bench/probes/probe_host.py --layers 8 --length 33000 --policies full,streamingllm,h2o \
      --out "$OUT/host_V_l8_33k.json" > "$OUT/host_V_l8_33k.log" 2>&1; grep "^{" "$OUT/host_V_l8_33k.log"
  timeout 360 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies full,snapkv,raas,quest,asl,art \
      --prefill-compiler eager --out "$OUT/l8_V_130k.json" > "$OUT/l8_V_130k.log" 2>&1
  ;;
X)   # 2026-11-28, a 4-GPU machine: the shared-layer compile (kvpass.compiler.layers) against inline layers in
     # one call, and half of tests/gpu beside it (Y runs the other half)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  bash bench/calls/lanes.sh "$OUT" 545 'OUT=$LANE bash bench/calls/fastpath_calls.sh X0' 'OUT=$LANE bash bench/calls/fastpath_calls.sh X1' \
      "$T tests/gpu/test_gpu_slot_cache.py -k replay_equals" \
      "$T tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_a3.py"
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
X0)  # 32 layers, full, shared layers: a first process and a second on its caches; then 8 layers at 130k
  export TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-X0
  for p in 1 2; do
    timeout 130 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies full \
        --prefill-compiler eager --out "$OUT/l32_shared_process$p.json" > "$OUT/l32_shared_process$p.log" 2>&1
  done
  timeout 260 python bench/bench_fastpath.py --layers 8 --lengths 2000,130000 --policies full,quest,raas,art \
      --prefill-compiler eager --out "$OUT/l8_shared_130k.json" > "$OUT/l8_shared_130k.log" 2>&1
  grep -h "^{" "$OUT"/*.log | cut -c1-400
  exit ;;
X1)  # beside X0: 32 layers, full, every layer inline (as before the shared-layer compile), first process; snapkv shared, first
     # process; then the decoding loop's GPU tests (CUDA graphs, one compile for every length) on the shared layers
  TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-X1a timeout 150 python bench/bench_fastpath.py --layers 32 \
      --lengths 2000,33000 --policies full --prefill-compiler eager --no-share-layers \
      --out "$OUT/l32_inline_process1.json" > "$OUT/l32_inline_process1.log" 2>&1
  export TORCHINDUCTOR_CACHE_DIR=/tmp/kvpass-inductor-X1b
  timeout 140 python bench/bench_fastpath.py --layers 32 --lengths 2000,33000 --policies snapkv \
      --prefill-compiler eager --out "$OUT/l32_shared_snapkv_process1.json" > "$OUT/l32_shared_snapkv_process1.log" 2>&1
  timeout 230 python -m pytest -v -rfE --tb=short -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py \
      -k "decode_loop or (compile_once and (full or quest or raas or asl))" > "$OUT/gpu_tests.txt" 2>&1
  grep -h "^{" "$OUT"/*.log | cut -c1-400; grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt"
  exit ;;
Z)   # two GPUs (lanes): the shared-layer fixes that followed X on the GPU (compile-once
     # quest failed with a KeyError, raas fell back; fixed on the CPU), and where AOTAutograd's 19.5 s go
     # (bench/probes/probe_compile.py: Triton mutation analysis per traced call, without and with a memo)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  F=tests/gpu/test_gpu_slot_cache.py
  bash bench/calls/lanes.sh "$OUT" 545 \
      "TORCHINDUCTOR_CACHE_DIR=/tmp/ind-Z0 timeout 120 python bench/probes/probe_compile.py --out \$LANE/probe_plain.json; $T $F -k 'compile_once or sliding'" \
      "TORCHINDUCTOR_CACHE_DIR=/tmp/ind-Z1 timeout 120 python bench/probes/probe_compile.py --memo --out \$LANE/probe_memo.json; $T $F tests/gpu/test_gpu_admission.py -k 'decode_loop or queue'"
  grep -hE "^\{|passed|failed" "$OUT"/lane*.log | cut -c1-400
  exit ;;
W)   # 2026-11-28, four GPUs (lanes): Z's two lanes (the shared-layer fixes, AOTAutograd's time with and
     # without a TTIR memo) beside Z2's (the rest of tests/gpu but the asl/foundation/hostile and two-GPU files)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  F=tests/gpu/test_gpu_slot_cache.py
  bash bench/calls/lanes.sh "$OUT" 560 \
      "TORCHINDUCTOR_CACHE_DIR=/tmp/ind-W0 timeout 120 python bench/probes/probe_compile.py --out \$LANE/probe_plain.json; $T $F -k 'compile_once or sliding'" \
      "TORCHINDUCTOR_CACHE_DIR=/tmp/ind-W1 timeout 120 python bench/probes/probe_compile.py --memo --out \$LANE/probe_memo.json; $T $F tests/gpu/test_gpu_admission.py -k 'decode_loop or queue'" \
      "$T $F -k replay_equals" \
      "$T tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_a3.py"
  grep -hE "^\{|passed|failed" "$OUT"/lane*.log | cut -c1-400
  exit ;;
W2)  # 2026-11-28, after W, four GPUs: the compile time alone on its GPU (32 layers: full in a first process and a
     # second on its caches, snapkv first); the GPU tests W left (the sliding replay after the shared-layer fix, the
     # last a3 test) and the asl/foundation/hostile files; 8 layers at 33k for every policy; 32 layers at 130k
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  F=tests/gpu/test_gpu_slot_cache.py
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 570 \
      "export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-W2; for p in 1 2; do $B --layers 32 --lengths 2000,33000 --policies full --out \$LANE/l32_full_process\$p.json > \$LANE/l32_full_process\$p.log 2>&1; done; TORCHINDUCTOR_CACHE_DIR=/tmp/ind-W2b $B --layers 32 --lengths 2000,33000 --policies snapkv --out \$LANE/l32_snapkv_process1.json > \$LANE/l32_snapkv_process1.log 2>&1; grep -h '^{' \$LANE/*.log | cut -c1-300" \
      "$T $F tests/gpu/test_gpu_a3.py -k 'sliding_layers or slot_decode_cuda_graphs'; $T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_hostile.py" \
      "$B --layers 8 --lengths 2000,33000 --policies full,snapkv,quest,raas,art,asl,h2o,pyramidkv,streamingllm --out \$LANE/l8_33k.json > \$LANE/l8_33k.log 2>&1; grep -h '^{' \$LANE/l8_33k.log | cut -c1-300" \
      "$B --layers 32 --lengths 2000,130000 --policies full,snapkv,raas --out \$LANE/l32_130k.json > \$LANE/l32_130k.log 2>&1; grep -h '^{' \$LANE/l32_130k.log | cut -c1-300"
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
W3)  # 2026-11-28, after W2 (580 s of device time left), four GPUs: the GPU tests W2's cut left (the Inductor
     # families, streamingllm, the hostile cases) on GPUs 0 and 1; tests/gpu/test_gpu_tp.py on GPUs 2-3
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  bash bench/calls/lanes.sh "$OUT" 400 "$T tests/gpu/test_gpu_foundation.py -k full_inductor" \
      "$T tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_hostile.py -k 'streamingllm_generate or case7'" \
      'CUDA_VISIBLE_DEVICES=2,3 timeout 390 python -m pytest -v -rfE --tb=short -p no:cacheprovider tests/gpu/test_gpu_tp.py'
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
Y)   # 2026-11-28, four GPUs: the GPU tests of the shared-layer change that followed W3 (what a layer writes, read
     # off the graph: test_gpu_hostile errored on the version before it) and the compile-once / sliding paths; 32
     # layers at 130k beside full; tests/gpu/test_gpu_tp.py on GPUs 2-3 (each run is named on stdout before it starts)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 575 "$T tests/gpu/test_gpu_hostile.py tests/gpu/test_gpu_slot_cache.py -k 'case7 or sliding or compile_once'" \
      "$B --layers 32 --lengths 2000,130000 --policies full,quest,streamingllm,h2o --out \$LANE/l32_130k_a.json > \$LANE/l32_130k_a.log 2>&1; grep -h '^{' \$LANE/l32_130k_a.log | cut -c1-300" \
      'CUDA_VISIBLE_DEVICES=2,3 timeout 560 python -m pytest -v -rfE --tb=short -p no:cacheprovider tests/gpu/test_gpu_tp.py'
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
V1)  # 2026-11-28, two GPUs (4-GPU machines were no longer lent after Y and Y2): the fast path's rows still missing at
     # 32 layers: art and h2o at 130k beside full (Y's and Y2's lanes ran out of time before them); five policies at 33k
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 575 \
      "$B --layers 32 --lengths 2000,130000 --policies full,art,h2o --out \$LANE/l32_130k_d.json > \$LANE/l32_130k_d.log 2>&1; grep -h '^{' \$LANE/l32_130k_d.log | cut -c1-300" \
      "$B --layers 32 --lengths 2000,33000 --policies full,quest,streamingllm,asl,pyramidkv --out \$LANE/l32_33k_a.json > \$LANE/l32_33k_a.log 2>&1; grep -h '^{' \$LANE/l32_33k_a.log | cut -c1-300"
  exit ;;
V2)  # 2026-11-28, two GPUs: the rest of 32 layers at 33k (raas's first compile alone takes about 2 minutes) beside a
     # regression run of the decoding loop, CUDA-graph replay and Inductor family GPU tests
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 575 \
      "$B --layers 32 --lengths 2000,33000 --policies full,raas,art,h2o --out \$LANE/l32_33k_b.json > \$LANE/l32_33k_b.log 2>&1; grep -h '^{' \$LANE/l32_33k_b.log | cut -c1-300" \
      "python -m pytest -v -rfE --tb=short -p no:cacheprovider tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_slot_cache.py -k 'decode_loop or replay_equals or full_inductor'"
  exit ;;
V3)  # 2026-11-28, two GPUs: tests/gpu/test_gpu_tp.py, then the two-GPU step's profile (bench/calls/tp_calls.sh R, full)
  timeout 360 python -m pytest -v -rfEs --tb=short -p no:cacheprovider tests/gpu/test_gpu_tp.py > "$OUT/gpu_tp_tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/gpu_tp_tests.txt" | tail -3
  CONFIGS=full ONE_S=100 TWO_S=120 bash bench/calls/tp_calls.sh R
  exit ;;
V4)  # 2026-11-28, two GPUs: raas's stamp with partial log-sum-exps (the plan no longer walks every page): its GPU
     # tests, the kernel timings with and without the partials, and raas beside full at 32 layers, 33k and 130k;
     # then h2o and art (V1 left h2o at 130k, V2 never ran) as far as the lanes time allows (rows are saved as they end)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 575 \
      "$T tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_slot_cache.py -k 'raas_stamp or no_evict or long_decode or (slot_cache and raas)' > \$LANE/gpu_tests.txt 2>&1; grep -E 'passed|failed' \$LANE/gpu_tests.txt; python bench/probes/tune_small_kernels.py --only stamp --out \$LANE/tune_stamp.json > \$LANE/tune_stamp.log 2>&1; $B --layers 32 --lengths 2000,33000 --policies full,raas,h2o,art --out \$LANE/l32_33k_raas.json > \$LANE/l32_33k_raas.log 2>&1; grep -h '^{' \$LANE/*.log | cut -c1-300" \
      "$B --layers 32 --lengths 2000,130000 --policies full,raas,h2o --out \$LANE/l32_130k_raas.json > \$LANE/l32_130k_raas.log 2>&1; grep -h '^{' \$LANE/l32_130k_raas.log | cut -c1-300"
  exit ;;
V6)  # 2026-11-28, after V4, two GPUs: the two 32-layer rows lanes cut twice (h2o at 130k came third in its lane in V1 and
     # V4; art at 33k fourth in V4), each now second after full; then the two-GPU profile (tp_calls.sh R) at 8
     # layers, where a call after V4 was refused (no two-GPU machine was lent then). Lane 1 first runs
     # the GPU tests of the changes after V4 (the raas plan's window load, the decoding loop's last-step read)
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider -p no:logging'
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 540 \
      "$B --layers 32 --lengths 2000,130000 --policies full,h2o --out \$LANE/l32_130k_h2o.json > \$LANE/l32_130k_h2o.log 2>&1; grep -h '^{' \$LANE/l32_130k_h2o.log | cut -c1-300" \
      "$T tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_slot_cache.py -k 'raas_stamp or decode_loop' > \$LANE/gpu_tests.txt 2>&1; grep -E 'passed|failed' \$LANE/gpu_tests.txt; $B --layers 32 --lengths 2000,33000 --policies full,art --out \$LANE/l32_33k_art.json > \$LANE/l32_33k_art.log 2>&1; grep -h '^{' \$LANE/l32_33k_art.log | cut -c1-300"
  exit ;;
Y2)  # 2026-11-28, beside Y, four GPUs: the other policies at 32 layers and 130k beside full; the tensor-parallel 128k step on one GPU
     # and on two (bench/calls/tp_calls.sh T1) on GPUs 2-3
  B='python bench/bench_fastpath.py --prefill-compiler eager'
  bash bench/calls/lanes.sh "$OUT" 575 \
      "$B --layers 32 --lengths 2000,130000 --policies full,pyramidkv,asl,art --out \$LANE/l32_130k_b.json > \$LANE/l32_130k_b.log 2>&1; grep -h '^{' \$LANE/l32_130k_b.log | cut -c1-300" \
      "$B --layers 32 --lengths 2000,130000 --policies full,raas --out \$LANE/l32_130k_c.json > \$LANE/l32_130k_c.log 2>&1; grep -h '^{' \$LANE/l32_130k_c.log | cut -c1-300" \
      'CUDA_VISIBLE_DEVICES=2,3 CONFIGS=full,snapkv,asl@layer=8 ONE_S=240 TWO_S=280 OUT=$LANE bash bench/calls/tp_calls.sh T1'
  exit ;;
Z2)  # two GPUs: the rest of tests/gpu but the two-GPU file
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  bash bench/calls/lanes.sh "$OUT" 545 "$T tests/gpu/test_gpu_slot_cache.py -k replay_equals" \
      "$T tests/gpu/test_gpu_art.py tests/gpu/test_gpu_eviction.py tests/gpu/test_gpu_raas.py tests/gpu/test_gpu_a3.py"
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
Z3)  # two GPUs: the gated and foundation GPU tests; 8 layers at 33k for every policy
  T='python -m pytest -v -rfE --tb=short -p no:cacheprovider'
  bash bench/calls/lanes.sh "$OUT" 545 "$T tests/gpu/test_gpu_asl.py tests/gpu/test_gpu_foundation.py tests/gpu/test_gpu_hostile.py" \
      'python bench/bench_fastpath.py --layers 8 --lengths 2000,33000 --policies full,snapkv,quest,raas,art,asl,h2o,pyramidkv,streamingllm --prefill-compiler eager --out $LANE/l8_33k.json > $LANE/l8_33k.log 2>&1; grep -h "^{" $LANE/l8_33k.log | cut -c1-400'
  grep -hE "passed|failed" "$OUT"/lane*.log
  exit ;;
esac
grep -h "^{" "$OUT"/*.log 2>/dev/null | cut -c1-600
