#!/usr/bin/env bash
# Throughput calls of bench/bench_throughput.py and bench/bench_prefill.py (one GPU each, $OUT set): `bash bench/calls/throughput_calls.sh A|B|C|D`.
# Run 2026-11-27 (bench/results/throughput_2026-11-27): A1, A2 (first run, H100); B, C, D, E, F (second run, two H200s);
# G, H, I, J, K, L (third run, two H200s); M, N, O (fourth run, two H100s); P was written after them.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T="python bench/bench_throughput.py"
case "$1" in
A1) timeout 560 $T --layers 8 --context 32768 --new 256 --requests 16 --kv-gib 4 --policies full,snapkv,raas,streamingllm \
        --baselines hf_static,hf_continuous --out "$OUT/l8_long_context_1.json" > "$OUT/l8_long_context_1.log" 2>&1 ;;
A2) timeout 440 $T --layers 8 --context 32768 --new 256 --requests 16 --kv-gib 4 --policies quest,h2o,pyramidkv,asl \
        --baselines hf_static,hf_continuous --out "$OUT/l8_long_context_2.json" > "$OUT/l8_long_context_2.log" 2>&1 ;;
# 32 layers (weights 15 GiB) with 16 GiB of KV: full about 3 rows of 32k beside the staging row, the compressing
# policies about 55 rows. About 100 s of prefill for 64 requests: a configuration whose batch is small runs 4
# waves of it (--max-waves). B and D run together on a two-GPU machine (one GPU each, `full` on both).
B)  timeout 570 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16 --workspace-gib 10 --max-waves 4 \
        --policies full,streamingllm,snapkv --baselines "" --out "$OUT/l32_long_context.json" > "$OUT/l32_long_context.log" 2>&1 ;;
# RaaS's setting: 1k prompts, 16k new tokens; per-step eviction (raas, streamingllm, h2o) against full. 4.25 GiB of
# KV: the compressing policies' 64 rows of about 65 MiB fit beside the staging row (at 4 GiB 62 did, and two
# requests ran a second 16k-step wave alone); full fits 6 rows of 548 MiB.
C)  timeout 520 $T --layers 8 --workload long_generation --context 1024 --new 16384 --requests 64 --kv-gib 4.25 --max-waves 2 \
        --policies full,raas,streamingllm,h2o --baselines "" --out "$OUT/l8_long_generation.json" \
        > "$OUT/l8_long_generation.log" 2>&1 ;;
D)  timeout 570 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16 --workspace-gib 10 --max-waves 4 \
        --policies full --baselines hf_static,hf_continuous --out "$OUT/l32_baselines.json" > "$OUT/l32_baselines.log" 2>&1 ;;
# Second run (two H200s, one GPU each): C on GPU 0; E on GPU 1 (continuous batching at 8 layers beside full, its
# threads' stacks every 60 s: at 32 layers it ran 300 s on 8 requests without a result; then the prefill peaks).
E)  timeout 170 $T --layers 8 --context 32768 --new 256 --requests 16 --kv-gib 4 --max-waves 2 --stacks-after 60 \
        --policies full --baselines hf_continuous --out "$OUT/l8_continuous.json" > "$OUT/l8_continuous.log" 2>&1
    timeout 390 python bench/bench_prefill.py --layers 8 --lengths 32768,131072 \
        --policies full,h2o,asl,snapkv,pyramidkv,streamingllm,quest,raas --out "$OUT/l8_prefill.json" > "$OUT/l8_prefill.log" 2>&1 ;;
# F (second run, beside C): where asl's 128k prefill peak (1.7x full's) comes from, then the GPU tests left.
F)  for p in full asl; do timeout 100 python bench/probes/diag_prefill.py --layers 8 --context 131072 --policy $p \
        > "$OUT/diag_prefill_$p.log" 2>&1; done
    timeout 330 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py tests/gpu/test_gpu_admission.py \
        tests/gpu/test_gpu_eviction.py -k "decode_loop or (admission and art) or compile_once or sliding or policy_on_gpu \
        or (replay and (raas or art or h2o or asl or sablock or gemfilter or fastkv))" > "$OUT/gpu_tests_F.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_F.txt" | tail -40 ;;
# Third run (two GPUs, one call): G on GPU 0, H on GPU 1.
# G: what asl's 128k prefill holds at its peak, through generate (full beside it), then the GPU tests F did not reach.
G)  for p in full asl; do timeout 150 python bench/probes/diag_prefill.py --generate --layers 8 --context 131072 --policy $p \
        > "$OUT/diag_prefill_generate_$p.log" 2>&1; done
    timeout 270 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py tests/gpu/test_gpu_admission.py \
        tests/gpu/test_gpu_eviction.py -k "decode_loop or (admission and art) or compile_once or sliding or policy_on_gpu" \
        > "$OUT/gpu_tests_G.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_G.txt" | tail -40 ;;
# H: the other compressing policies at 32 layers (16.5 GiB of KV: 63 rows of 258 MiB fit the queue; full 3 rows).
H)  timeout 570 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16.5 --workspace-gib 10 --max-waves 4 \
        --policies snapkv,h2o,full --baselines "" --out "$OUT/l32_long_context_2.json" > "$OUT/l32_long_context_2.log" 2>&1 ;;
# Third run, a second call on two GPUs. I (GPU 0): the scoring kernel's tiles, the prefill peaks after the mask fix,
# the GPU tests G did not reach. J (GPU 1): long generation on 32 layers (eager prefill: 1k-token prompts).
I)  timeout 200 python bench/probes/tune_accumulated.py --out "$OUT/tune_accumulated.json" > "$OUT/tune_accumulated.log" 2>&1
    timeout 200 python bench/bench_prefill.py --layers 8 --lengths 32768,131072 --policies full,asl \
        --out "$OUT/l8_prefill_asl.json" > "$OUT/l8_prefill_asl.log" 2>&1
    timeout 170 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_admission.py tests/gpu/test_gpu_eviction.py \
        tests/gpu/test_gpu_slot_cache.py -k "decode_loop or (admission and art) or policy_on_gpu or (compile_once and \
        not (full or streamingllm or snapkv or quest))" > "$OUT/gpu_tests_I.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_I.txt" | tail -40 ;;
J)  timeout 580 $T --layers 32 --workload long_generation --context 1024 --new 16384 --requests 64 --kv-gib 17 \
        --workspace-gib 8 --max-waves 1 --prefill-compiler eager --policies streamingllm,full --baselines "" \
        --out "$OUT/l32_long_generation.json" > "$OUT/l32_long_generation.log" 2>&1 ;;
# Third run, last call. K (GPU 0): the one-pass h2o scoring (attention_lse) on the GPU and its prefill time,
# then the GPU tests not reached. L (GPU 1): h2o and asl at 32 layers, long context (16.5 GiB of KV, as H).
K)  timeout 100 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_eviction.py -k "attention_lse or accumulated \
        or (policy_on_gpu and h2o)" > "$OUT/gpu_tests_K1.txt" 2>&1
    timeout 170 python bench/bench_prefill.py --layers 8 --lengths 32768,131072 --policies full,h2o \
        --out "$OUT/l8_prefill_h2o.json" > "$OUT/l8_prefill_h2o.log" 2>&1
    timeout 230 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py tests/gpu/test_gpu_admission.py \
        -k "decode_loop or (compile_once and not (full or streamingllm or snapkv or quest or raas))" \
        > "$OUT/gpu_tests_K2.txt" 2>&1
    grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT"/gpu_tests_K*.txt | tail -40 ;;
L)  timeout 500 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16.5 --workspace-gib 10 --max-waves 4 \
        --policies h2o,asl --baselines "" --out "$OUT/l32_long_context_3.json" > "$OUT/l32_long_context_3.log" 2>&1 ;;
# Fourth run, one call on two GPUs. M (GPU 0): h2o's one-pass scoring with the diagonal-only masking (merge branch
# h2o-diagonal-mask first: its tiles, its GPU tests, then its first-token time beside full). N (GPU 1): the 32-layer long-context rows not run (asl, pyramidkv).
M)  timeout 110 python -m pytest -v -p no:cacheprovider tests/gpu/test_gpu_eviction.py -k "attention_lse or accumulated" \
        > "$OUT/gpu_tests_M.txt" 2>&1
    timeout 230 python bench/probes/tune_accumulated.py --out "$OUT/tune_accumulated.json" > "$OUT/tune_accumulated.log" 2>&1
    timeout 200 python bench/bench_prefill.py --layers 8 --lengths 32768,131072 --policies full,h2o \
        --out "$OUT/l8_prefill_h2o.json" > "$OUT/l8_prefill_h2o.log" 2>&1
    grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT"/gpu_tests_M.txt | tail -20 ;;
N)  timeout 560 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16.5 --workspace-gib 10 --max-waves 4 \
        --policies asl,pyramidkv,full --baselines "" --out "$OUT/l32_long_context_4.json" > "$OUT/l32_long_context_4.log" 2>&1 ;;
# Fourth run (N ran on two H100s: asl and pyramidkv; full was cut). O: full beside asl in one process (32 layers).
# P: the scoring kernel's tiles after the diagonal-only masking, then h2o's first token beside full.
O)  timeout 560 $T --layers 32 --context 32768 --new 256 --requests 64 --kv-gib 16.5 --workspace-gib 10 --max-waves 4 \
        --policies full,asl --baselines "" --out "$OUT/l32_long_context_5.json" > "$OUT/l32_long_context_5.log" 2>&1 ;;
P)  timeout 230 python bench/probes/tune_accumulated.py --out "$OUT/tune_accumulated.json" > "$OUT/tune_accumulated.log" 2>&1
    timeout 200 python bench/bench_prefill.py --layers 8 --lengths 32768,131072 --policies full,h2o \
        --out "$OUT/l8_prefill_h2o_P.json" > "$OUT/l8_prefill_h2o_P.log" 2>&1 ;;
esac
grep -h "^{" "$OUT"/*.log 2>/dev/null | cut -c1-400
