#!/usr/bin/env bash
# Decode-step device calls (bench/bench_decode_step.py and its GPU tests; one GPU each, under 10 minutes):
# results land in $OUT.
#   A: 8 layers, batch 1, 32k: HF eager (cuDNN SDPA off / on), HF StaticCache + CUDA graphs, kvpass policies
#   B: 8 layers, batch 16, 32k;   C: 8 layers, batch 1, 128k
#   L: 32 layers (the whole 8B shape), batch 1, 32k
#   G: the gated policies on a SlotCache, 8 layers, batch 1, 32k (and full, for the ratio)
#   Q: 8 layers, batch 1, 128k: the decode-time policies (quest, art, raas) beside full
#   H: the hostile DynamicCache case (tests/gpu/test_gpu_hostile.py's shape): raas, asl, art at 4,096 then 128k tokens (full beside)
#   D: where a SlotCache prefill spends time and memory (bench/probes/diag_prefill.py)
#   M: gemfilter on a SlotCache (8 layers, 32k), then the policies at 32 layers, 32k
#   P: kernel tables (--profile): full, quest, art, raas at 128k; R: the same and snapkv at 32k, then full
#      at 2k (the step with almost no KV: weights and launches alone)
#   B2: 8 layers, batch 16, 32k, the policies that keep the prompt (full, quest, art, raas) and the gated
#      ones: their prefill at batch 16 needs more than an H100's 80 GB beside the full cache (run it on an H200)
#   E: the batch-16 TTFT (28-43 s on 2026-11-23, DynamicCache path): snapkv at batch 16, 32k, on the
#      DynamicCache path beside the SlotCache path (6.5 s on 2026-11-25)
#   X: batch 16 asl at 32k (needs an H200), then full at 2k and 32k under mode="max-autotune" beside
#      reduce-overhead (do Triton matmul templates beat cuBLAS's GEMVs on the floor?)
#   Y: full and snapkv at 2k under reduce-overhead and max-autotune in one process (the floor, matmul autotuning)
#   Z: a long generation: 2k prompt, decoded to 32k tokens (raas and streamingllm evict decode tokens; full,
#      snapkv keep them), timed over the last 64 steps
#   U: raas's fused per-layer update (kvpass::raas_stamp): its GPU tests and the CUDA-graph replay tests of
#      raas, then full and raas at 32k (batch 1)
#   S: the small per-layer kernels alone (bench/probes/tune_small_kernels.py: ART's scan, quest's top_pages)
#   T: tests/gpu/test_gpu_slot_cache.py and tests/gpu/test_gpu_hostile.py
#   V: h2o: its GPU tests (CUDA-graph replay = eager), then full, streamingllm, snapkv and h2o at 32k
#      (batch 1); W: h2o in its own setting, a 2k prompt decoded to 32k tokens, beside full and streamingllm
#   K: the kvpress 0.5.5 baseline (bench/bench_kvpress.py), 8 layers, batch 1, 32k and 128k: hf_eager,
#      SnapKVPress, StreamingLLMPress at the 2,048-token budget, in a second process on transformers 5.2.
#      kvpress needs transformers < 5.3, so its wheels (kvpress, transformers 5.2.0, tokenizers 0.22.2,
#      datasets, dill, multiprocess, cachetools, fire, termcolor) travel in .whl/, ignored through
#      .git/info/exclude (bench/calls/kvpress_wheels.sh fetches them): this call needs carry: [".whl"]; they go to
#      /tmp/site, ahead on PYTHONPATH
set -u
out=${OUT:?set OUT}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
B="python bench/bench_decode_step.py --layers 8"
case "${1:?call A-D, B2, E, G, H, K, L, M, P, Q, R, S, T, U, V, W, X, Y or Z}" in
  A) timeout 560 $B --batch 1 --contexts 32768 --out $out/b1_32k.json \
       --configs hf_eager,hf_eager_cudnn,hf_static,full,streamingllm,snapkv,pyramidkv,quest,art,raas 2>&1 | grep '^{' ;;
  G) timeout 560 $B --batch 1 --contexts 32768 --out $out/b1_32k_gated.json \
       --configs full,asl@layer=2,asl,fastkv,asl_2pass@layer=2,asl_fullkv@layer=2 2>&1 | grep '^{' ;;
  Q) timeout 560 $B --batch 1 --contexts 131072 --out $out/b1_128k_decode_policies.json \
       --configs full,quest,art,raas 2>&1 | grep '^{' ;;
  H) timeout 560 $B --batch 1 --contexts 4096,131072 --steps 32 --out $out/b1_dynamic_cache_case7.json \
       --configs kvpass_dynamic:full,kvpass_dynamic:raas,kvpass_dynamic:asl,kvpass_dynamic:art 2>&1 | grep '^{' ;;
  L) timeout 590 python bench/bench_decode_step.py --layers 32 --batch 1 --contexts 32768 --out $out/b1_32k_32layers.json \
       --configs hf_eager,hf_static,full,snapkv,quest,art,raas 2>&1 | grep '^{' ;;
  B) timeout 560 $B --batch 16 --contexts 32768 --out $out/b16_32k.json \
       --configs hf_eager,full,snapkv,pyramidkv,streamingllm,hf_static 2>&1 | grep "^{" ;;
  C) timeout 560 $B --batch 1 --contexts 131072 --out $out/b1_128k.json \
       --configs hf_eager,full,snapkv,pyramidkv,streamingllm,hf_static 2>&1 | grep "^{" ;;
  M) timeout 200 $B --batch 1 --contexts 32768 --out $out/b1_32k_gemfilter.json --configs full,gemfilter 2>&1 | grep '^{'
     timeout 390 python bench/bench_decode_step.py --layers 32 --batch 1 --contexts 32768 \
       --out $out/b1_32k_32layers_policies.json --configs full,snapkv,quest,art,raas,asl@layer=8 2>&1 | grep '^{' ;;
  D) timeout 300 python bench/probes/diag_prefill.py --layers 8 --context 32768 --policy full --dynamic > $out/diag_prefill_32k.json
     tail -c 3000 $out/diag_prefill_32k.json ;;
  P) timeout 560 $B --batch 1 --contexts 131072 --profile --out $out/b1_128k_profile.json \
       --configs full,quest,art,raas 2>&1 | grep -v DEBUG | grep '^[{ ]' ;;
  R) timeout 420 $B --batch 1 --contexts 32768 --profile --out $out/b1_32k_profile.json \
       --configs full,snapkv,quest,art,raas 2>&1 | grep -v DEBUG | grep '^[{ ]'
     timeout 120 $B --batch 1 --contexts 2048 --profile --out $out/b1_2k_full_profile.json \
       --configs full 2>&1 | grep -v DEBUG | grep '^[{ ]' ;;
  E) timeout 560 $B --batch 16 --contexts 32768 --out $out/b16_32k_dynamic_ttft.json \
       --configs kvpass_dynamic:snapkv,snapkv 2>&1 | grep "^{" ;;
  B2) timeout 560 $B --batch 16 --contexts 32768 --out $out/b16_32k_keep.json \
       --configs full,quest,art,raas,gemfilter,asl@layer=2 2>&1 | grep "^{" ;;
  K) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
       || exit 1
     PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 480 python3 bench/bench_kvpress.py --layers 8 --batch 1 \
       --contexts 32768,131072 --out $out/b1_kvpress.json --configs hf_eager,kvpress:SnapKVPress,kvpress:StreamingLLMPress \
       2>&1 | tee $out/b1_kvpress.log | grep -E '^\{|Error' ;;
  X) timeout 300 $B --batch 16 --contexts 32768 --out $out/b16_32k_asl.json --configs full,asl@layer=2 2>&1 | grep "^{"
     timeout 280 $B --batch 1 --contexts 2048,32768 --mode max-autotune --out $out/b1_max_autotune.json \
       --configs full,snapkv 2>&1 | grep "^{" ;;
  Y) timeout 560 $B --batch 1 --contexts 2048 --out $out/b1_2k_autotune.json \
       --configs full,autotune:full,snapkv,autotune:snapkv 2>&1 | grep '"config"' ;;
  Z) timeout 580 $B --batch 1 --contexts 2048 --decode-to 32768 --out $out/b1_2k_decode_to_32k.json \
       --configs full,raas,streamingllm,snapkv 2>&1 | grep '"config"' ;;
  U) python -m pytest -p no:cacheprovider -p no:logging --tb=short -q tests/gpu/test_gpu_raas.py \
       tests/gpu/test_gpu_slot_cache.py -k raas 2>&1 | grep --line-buffered -v DEBUG | tee $out/gpu_tests_raas.txt | tail -4
     timeout 280 $B --batch 1 --contexts 32768 --out $out/b1_32k_raas.json --configs full,raas 2>&1 | grep '"config"' ;;
  V) python -m pytest -p no:cacheprovider -p no:logging --tb=short -q tests/gpu/test_gpu_slot_cache.py -k h2o 2>&1 \
       | grep --line-buffered -v DEBUG | tee $out/gpu_tests_h2o.txt | tail -4
     timeout 400 $B --batch 1 --contexts 32768 --out $out/b1_32k_h2o.json --configs full,streamingllm,snapkv,h2o \
       2>&1 | grep '"config"' ;;
  W) timeout 580 $B --batch 1 --contexts 2048 --decode-to 32768 --out $out/b1_2k_decode_to_32k_h2o.json \
       --configs full,streamingllm,h2o 2>&1 | grep '"config"' ;;
  S) timeout 300 python bench/probes/tune_small_kernels.py --out $out/small_kernels.json 2>&1 | grep '^{' ;;
  T) python -m pytest -p no:cacheprovider -p no:logging --tb=short -v ${TESTS:-tests/gpu/test_gpu_slot_cache.py tests/gpu/test_gpu_hostile.py} 2>&1 \
       | grep --line-buffered -v DEBUG | tee $out/gpu_tests.txt | tail -5 ;;
esac
