#!/usr/bin/env bash
# Tensor-parallel device calls (bench/bench_tp.py and its GPU tests), on two GPUs of one host (nvidia-h200-x2 / nvidia-h100-x2); results land in $OUT.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others the machine sets; set again here).
#   T1: the 32-layer Llama-3.1-8B shape saved once, then full, snapkv, raas and asl (selection layer 8) at 128k on
#       one GPU and on two (torchrun, tp_plan="auto"), then the comparison table
#   T2: the same at 32k
#   G: tests/gpu/test_gpu_tp.py (every plain policy split over two GPUs with NCCL against one GPU, fp32)
#   Q3: G's Qwen3 cases on a carried transformers 5.24 (the machine's 5.17 cannot compile a split Qwen3)
#   K: the decode kernel alone at one rank's share (16 query heads, 4 KV heads, batch 1, 128k) with the split
#      cap before (64) and now (256), and the whole shape (32, 8): does the cap explain part of the TP step?
#   S: full and snapkv at 128k on two GPUs with NCCL's all_reduce, then with symmetric memory's one-shot
#      all-reduce lowered by Inductor (bench_tp.py --one-shot), for the all-reduce share of the step
#   R: T1 with a kernel profile of each row (bench_tp.py --profile): device time per step by kind (NCCL's
#      all-reduce, kvpass's attention, matmuls, the rest) on one GPU and on two, for where the two-GPU step loses
#   R8: R at 8 layers, full only (about 4 minutes with the machine's start: written for a call with only that much
#       device time left): where the step's device time goes, per layer
#   S8: R8's model and row on two GPUs with a static batch (--static-batch), NCCL's all-reduce then symmetric
#       memory's one-shot (--one-shot): 16 all-reduces a step at 8 layers took 0.155 ms of 2.112 (2026-11-28); the
#       one-shot lowering failed on the symbolic batch of dynamic=True (Inductor compares its size with a threshold)
#   K2: the decode kernel at a rank's share (16 query, 4 KV heads, batch 1, 128k) with split caps 32, 64 and 128
#       (132 splits now: a rank's kernel reads at 3.0 TB/s where one GPU's reads at 3.4), and the whole shape
#   M8: the matmul share at 8 layers (a rank's matmuls took 0.63x one GPU's, 2026-11-28): one GPU and two with a
#       static batch, then two GPUs with the one-shot all-reduce, with cuBLASLt as ATen's BLAS (and one GPU so), and
#       with Inductor's Triton mm templates autotuned beside ATen's (--mm-autotune)
#   H8: R8 for full and snapkv, with the host's time per step and a cProfile of the host (is a two-GPU step, snapkv's
#       above all, bound by the host's per-step work: Dynamo's guards on 226 DTensor parameters, the graph's wrappers?)
#   K3 (2026-11-28, ran at commit f7b5a75 with a floor on the blocks a split reads, since removed): 16/4 heads read
#       3.97 TB/s at 128k in 32 splits against 3.45 in 132; the split rule is now one program per SM
#   K4: the new rule (num_splits: one program per SM) on the kernel alone, 16/4 and 32/8 heads, batch 1 and 4, 32k
#       and 128k, against K3's rows (32/8 at 128k in 17 splits: K3 had 4.01 TB/s in 66 splits)
#   J: bench_projections.py, one layer's seven projection matmuls against q/k/v and gate/up fused into one each,
#      one GPU's and a rank's share, batch 1 and 4 (the lever for the rank's matmuls, not built)
#   H32: H8 at 32 layers (snapkv on one GPU; full and snapkv on two), Dynamo's guard time beside the host's
#   U8: the user's TPOT at 8 layers (model.generate through kvpass.compile, bench_tp.py --generate; usual, then with
#       direct_steps) beside the queued
#       step, full and snapkv on one GPU and on two
#   D1: one GPU: tests/gpu/test_gpu_direct_steps.py, then U8's measure on SmolLM2-135M's widths (host-bound) and
#       the 8-layer shape (full)
#   P: throughput at a fixed memory cap per GPU (P_POLICIES, P_ONE_S, P_TWO_S): an 8-layer model saved once, bench_throughput.py on
#      one GPU, then on two (torchrun, the same cap on each GPU), full and snapkv, 32k prompts
set -u -o pipefail
# the exit status: 1 when any step failed (a row's script, a timeout, no rows printed); each failure says which
fail=0; trap 'rc=$?; fail=1; echo "tp_calls: FAILED (rc $rc): $BASH_COMMAND" >&2' ERR
out=${OUT:?set OUT}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ckpt=/tmp/kvpass_llama8b
# Q3, Q3D: the transformers wheel the call carries (.whl) installed beside the machine's, first on the path
carried_transformers() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
}
ctx=${2:-}
case "${1:?call T1, T2, R, R8, H8, H32, U8, D1, S8, M8, K, K2, K4, J, G, Q3, Q3D, P or S}" in
  T1) ctx=${ctx:-131072} ;;
  T2) ctx=${ctx:-32768} ;;
  R) ctx=${ctx:-131072}; prof=--profile ;;
  K2) for hc in 16,4,32 16,4,64 16,4,128 16,4,256 32,8,256; do
       timeout 75 python bench/bench_decode_kernel.py --heads ${hc%,*} --batches 1 --contexts 131072 \
         --max-splits ${hc##*,} --no-sweep --out $out/k_${hc//,/_} 2>&1 | grep '^{\|Error' | cut -c1-400; done; exit $fail ;;
  J) # one layer's projections as the model runs them (7 matmuls) against q/k/v and gate/up fused (4), one GPU's
     # and a rank's share, batch 1 and 4: what fusing them would save (a rank's matmuls took 0.62x one GPU's)
     timeout 150 python bench/probes/bench_projections.py --out $out/projections.json 2>&1 | grep '^{\|Error' | cut -c1-400
     exit $fail ;;
  K4) for hs in 16,4 32,8; do
       timeout 60 python bench/bench_decode_kernel.py --heads $hs --batches 1,4 --contexts 32768,131072 --no-sweep \
         --out /tmp/k4 2>&1 | grep '^{\|Error' | cut -c1-400; done; exit $fail ;;
  K) for hs in 16,4 32,8; do for cap in 64 256; do
       python bench/bench_decode_kernel.py --heads $hs --batches 1 --contexts 32768,131072 --max-splits $cap \
         --no-sweep --out $out/kernel_${hs/,/_}_cap$cap 2>&1 | grep '^{'; done; done; exit $fail ;;
  G) timeout 560 python -m pytest -q -x tests/gpu/test_gpu_tp.py 2>&1 | tail -15; exit $fail ;;
  Q3) # the Qwen3 half of G on transformers >= 5.24 (5.17's plan hooks q_norm/k_norm with module backward hooks that
      # Dynamo cannot compile). Here first: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
      # -d .whl transformers==5.24.0; the call carries .whl (run's carry=[".whl"])
     carried_transformers || exit 1
     python -c "import transformers; print('transformers', transformers.__version__)"
     timeout ${Q3_S:-500} python -m pytest -q -rfEs -p no:cacheprovider ${Q3_ARGS:-} tests/gpu/test_gpu_tp.py \
       -k "${Q3_K:-qwen3}" 2>&1 | tail -${Q3_TAIL:-15}; exit $fail ;;
  Q3D) # Q3's worker alone with CUDA_LAUNCH_BLOCKING=1 (2026-11-28: a device-side assert on both ranks, after every
      # plain run, before the fusion runs; asynchronous, so the run that raised it is not known): the first traceback
      # and the kernel's own assertion line. Carries .whl as Q3.
     carried_transformers && export PYTHONPATH=$PYTHONPATH:$PWD/tests:$PWD || exit 1
     mkdir -p /tmp/q3 && python -c "import test_tensor_parallel as t; t._qwen3_gqa4().save_pretrained('/tmp/q3/model'); \
       print(','.join(t.PLAIN), ','.join(t.COMPILED))" > /tmp/q3/lists.txt || exit 1
     read plain compiled < /tmp/q3/lists.txt
     CUDA_LAUNCH_BLOCKING=1 timeout ${Q3_S:-170} python -m torch.distributed.run --nproc_per_node 2 tests/tp_worker.py \
       --model /tmp/q3/model --out /tmp/q3 --policies $plain --caches dynamic,slot --device cuda --fusion all \
       --compiled $compiled > $out/q3d_stdout.txt 2> /tmp/q3/stderr.txt
     echo "rc $?"; tail -3 $out/q3d_stdout.txt
     grep -n -m5 "Assertion\|device-side assert triggered\|index out of bounds" /tmp/q3/stderr.txt | cut -c1-600
     grep -n -m1 -A70 "^Traceback" /tmp/q3/stderr.txt | cut -c1-300; exit $fail ;;
  R8|H8) d=/tmp/kvpass_llama8b_l8; c="--dir $d --contexts 131072 --configs full --steps 32 --profile"
     [ $1 = H8 ] && c="--dir $d --contexts 131072 --configs full,snapkv --steps 32 --profile"
     [ -f $d/config.json ] || timeout 60 python bench/bench_tp.py save --dir $d --layers 8 2>&1 | grep '^{'
     timeout 150 python bench/bench_tp.py run $c --out $out/one_gpu_l8_131072.json 2>&1 | grep '^{\|Error' | cut -c1-400
     timeout 190 torchrun --nproc_per_node 2 bench/bench_tp.py run $c --out $out/two_gpu_l8_131072.json 2>&1 \
       | grep '^{\|Error' | cut -c1-400
     python bench/bench_tp.py compare $out/one_gpu_l8_131072.json $out/two_gpu_l8_131072.json \
       --out $out/tp_l8_131072.md 2>&1 | tail -30; exit $fail ;;
  H32) # H8 at 32 layers (2026-11-29: a rank's host took 6.7 ms a queued step of 7.6 against 0.76 on one GPU): H32_ONE
     # (snapkv: the T1 run of 2026-11-29 has full's pair) on one GPU, full and snapkv on two, with the host's cProfile, each
     # step waited for, and Dynamo's spans
     c="--dir $ckpt --contexts 131072 --steps 32 --profile"
     [ -f $ckpt/config.json ] || timeout 120 python bench/bench_tp.py save --dir $ckpt 2>&1 | grep '^{'
     timeout ${ONE_S:-150} python bench/bench_tp.py run $c --configs ${H32_ONE:-snapkv} --out $out/one_gpu_131072.json 2>&1 \
       | grep '^{\|Error' | cut -c1-300
     timeout ${TWO_S:-270} torchrun --nproc_per_node 2 bench/bench_tp.py run $c --configs full,snapkv \
       --out $out/two_gpu_131072.json 2>&1 | grep '^{\|Error' | cut -c1-300
     python bench/bench_tp.py compare $out/one_gpu_131072.json $out/two_gpu_131072.json --out $out/tp_131072.md 2>&1 \
       | tail -30; exit $fail ;;
  U8) # the user's TPOT at 8 layers (U_LAYERS=32: at 32 layers, ckpt's model): model.generate through kvpass.compile
     # (bench_tp.py --generate 128; usual, then direct_steps) beside the queued step, full and snapkv (U_CONFIGS),
     # on one GPU then two (U_GPUS=1 or 2: one of them; a 32-layer row takes 150-250 s, so one side per call)
     l=${U_LAYERS:-8}; d=/tmp/kvpass_llama8b_l$l; [ $l = 32 ] && d=$ckpt
     c="--dir $d --contexts 131072 --configs ${U_CONFIGS:-full,snapkv} --steps 32 --generate 128"
     [ -f $d/config.json ] || timeout 150 python bench/bench_tp.py save --dir $d --layers $l 2>&1 | grep '^{'
     if [ "${U_GPUS:-1}" != 2 ]; then
       timeout ${ONE_S:-200} python bench/bench_tp.py run $c --out $out/one_gpu_l${l}_131072.json 2>&1 \
         | grep '^{\|Error' | cut -c1-300; fi
     if [ "${U_GPUS:-2}" != 1 ]; then
       timeout ${TWO_S:-240} torchrun --nproc_per_node 2 bench/bench_tp.py run $c --out $out/two_gpu_l${l}_131072.json \
         2>&1 | grep '^{\|Error' | cut -c1-300; fi
     [ -f $out/one_gpu_l${l}_131072.json ] && [ -f $out/two_gpu_l${l}_131072.json ] && python bench/bench_tp.py compare \
       $out/one_gpu_l${l}_131072.json $out/two_gpu_l${l}_131072.json --out $out/tp_l${l}_131072.md 2>&1 | tail -12
     exit $fail ;;
  D1) # one GPU (2026-11-29: no two-GPU machine lent): direct steps under Inductor's CUDA graphs
     # (tests/gpu/test_gpu_direct_steps.py; D1_TEST=0 skips it), then the user's TPOT, usual and direct, where the
     # host can outlast the device (SmolLM2-135M's widths, D1_SMALL_LAYERS of them (16; 30 did not finish a row in
     # 200 s with --profile), 8k; full and snapkv), then the 8-layer Llama shape at 128k (full: a device-bound step)
     [ "${D1_TEST:-1}" = 0 ] || timeout ${D1_TEST_S:-200} python -m pytest -q -rfE -p no:cacheprovider \
       tests/gpu/test_gpu_direct_steps.py 2>&1 | tail -8
     l=${D1_SMALL_LAYERS:-16}; d=/tmp/kvpass_smollm2_shape_l$l
     [ -f $d/config.json ] || timeout 60 python bench/bench_tp.py save --dir $d --layers $l --small 2>&1 | grep '^{'
     timeout ${D1_SMALL_S:-260} python bench/bench_tp.py run --dir $d --contexts 8192 --configs full,snapkv --steps 32 \
       --generate 128 --out $out/one_gpu_small_l${l}_8192.json 2>&1 | grep '^{\|Error' | cut -c1-300
     d=/tmp/kvpass_llama8b_l8
     [ -f $d/config.json ] || timeout 60 python bench/bench_tp.py save --dir $d --layers 8 2>&1 | grep '^{'
     timeout ${D1_L8_S:-150} python bench/bench_tp.py run --dir $d --contexts 131072 --configs full --steps 32 \
       --generate 128 --out $out/one_gpu_l8_131072.json 2>&1 | grep '^{\|Error' | cut -c1-300
     exit $fail ;;
  S8) d=/tmp/kvpass_llama8b_l8
     [ -f $d/config.json ] || timeout 60 python bench/bench_tp.py save --dir $d --layers 8 2>&1 | grep '^{'
     for flag in "" --one-shot; do   # a static batch for both: the one-shot lowering failed on a symbolic one
       timeout 130 torchrun --nproc_per_node 2 bench/bench_tp.py run --dir $d --contexts 131072 --configs full \
         --steps 32 --profile --static-batch $flag --out $out/two_gpu_l8_131072_static${flag//-/_}.json 2>&1 \
         | grep '^{\|Error' | cut -c1-400
     done; exit $fail ;;
  M8) d=/tmp/kvpass_llama8b_l8; c="--dir $d --contexts 131072 --configs full --steps 32 --profile --static-batch"
     [ -f $d/config.json ] || timeout 60 python bench/bench_tp.py save --dir $d --layers 8 2>&1 | grep '^{'
     one() { timeout 100 python bench/bench_tp.py run $c "${@:2}" --out $out/one_gpu_l8_$1.json 2>&1 \
       | grep '^{\|Error' | cut -c1-300; }
     two() { timeout 140 torchrun --nproc_per_node 2 bench/bench_tp.py run $c "${@:2}" --out $out/two_gpu_l8_$1.json \
       2>&1 | grep '^{\|Error' | cut -c1-300; }
     one static; two static; two one_shot --one-shot; two cublaslt --blas cublaslt; one cublaslt --blas cublaslt
     two autotune --mm-autotune
     for v in static cublaslt; do python bench/bench_tp.py compare $out/one_gpu_l8_$v.json $out/two_gpu_l8_$v.json \
       --out $out/tp_l8_$v.md 2>&1 | tail -14; done; exit $fail ;;
  P) d=/tmp/kvpass_llama8b_l8
     [ -f $d/config.json ] || timeout 120 python bench/bench_tp.py save --dir $d --layers 8 2>&1 | grep '^{'
     common="--dir $d --context 32768 --new 256 --requests 16 --kv-gib 4 --policies ${P_POLICIES:-full,snapkv} --baselines= --max-waves 2"
     timeout ${P_ONE_S:-250} python bench/bench_throughput.py $common --out $out/tput_one_gpu.json 2>&1 | grep '^{' | cut -c1-400
     timeout ${P_TWO_S:-280} torchrun --nproc_per_node 2 bench/bench_throughput.py $common --out $out/tput_two_gpu.json 2>&1 \
       | grep '^{' | cut -c1-400; exit $fail ;;
  S) [ -f $ckpt/config.json ] || timeout 120 python bench/bench_tp.py save --dir $ckpt 2>&1 | grep '^{'
     for flag in "" --one-shot; do
       timeout 250 torchrun --nproc_per_node 2 bench/bench_tp.py run --dir $ckpt --contexts 131072 \
         --configs full,snapkv $flag --out $out/two_gpu_131072${flag//-/_}.json 2>&1 | grep '^{\|Error' | cut -c1-600
     done; exit $fail ;;
esac
configs=${CONFIGS:-full,snapkv,raas,asl@layer=8}
prof=${prof:-}
[ -f $ckpt/config.json ] || timeout 120 python bench/bench_tp.py save --dir $ckpt 2>&1 | grep '^{'
timeout ${ONE_S:-230} python bench/bench_tp.py run --dir $ckpt --contexts $ctx --configs $configs $prof \
  --out $out/one_gpu_$ctx.json 2>&1 | grep '^{\|Error' | cut -c1-600
timeout ${TWO_S:-260} torchrun --nproc_per_node 2 bench/bench_tp.py run --dir $ckpt --contexts $ctx --configs $configs $prof \
  --out $out/two_gpu_$ctx.json 2>&1 | grep '^{\|Error' | cut -c1-600
python bench/bench_tp.py compare $out/one_gpu_$ctx.json $out/two_gpu_$ctx.json --out $out/tp_$ctx.md 2>&1 | tail -12
exit $fail
