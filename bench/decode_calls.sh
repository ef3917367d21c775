#!/usr/bin/env bash
# Issue 19's device calls (one GPU each, ~9 minutes): results land in $OUT.
#   A: tests/gpu/test_gpu_slot_cache.py, then 8 layers, batch 1, 32k: HF baselines, full, streamingllm
#   B: 8 layers, batch 1: snapkv, art, kvpass's DynamicCache full at 32k; every row at 128k
#   C: 8 layers, batch 16, 32k
set -u
out=${OUT:?set OUT}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
B="python bench/bench_decode_step.py --layers 8"
case "${1:?call A-C}" in
  A) timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_slot_cache.py 2>&1 | tail -30 | tee $out/gpu_tests.txt
     timeout 330 $B --batch 1 --contexts 32768 --configs hf_eager,hf_eager_cudnn,full,streamingllm,hf_static \
       --out $out/b1_32k_a.json 2>&1 | grep -v Warning | tail -40 ;;
  B) timeout 540 $B --batch 1 --contexts 32768 --configs snapkv,art,kvpass_dynamic:full --out $out/b1_32k_b.json 2>&1 | tail -30 ;;
  C) timeout 540 $B --batch 16 --contexts 32768 --configs hf_eager,full,snapkv,streamingllm,hf_static \
       --out $out/b16_32k.json 2>&1 | tail -30 ;;
  D) timeout 540 $B --batch 1 --contexts 131072 --configs hf_eager,full,snapkv,streamingllm,hf_static \
       --out $out/b1_128k.json 2>&1 | tail -30 ;;
esac
