#!/usr/bin/env bash
# The oldest supported transformers (pyproject.toml's floor) with the oldest torch CI tests (2.13, the CPU build
# that lies on the CI machines' disk, and the Triton 3.6 the GPU machines run), beside install.sh's newest of both:
# a virtual environment that sees this Python's packages (the test tools, the model wheels) and overrides torch,
# Triton and transformers, then a subset of the suite that covers model loading, `full` equal to the uncompiled
# model on every family, every policy's eviction and no-op equality, the SlotCache policies against their
# DynamicCache path, the never-silently-wrong cases, kvpass.compile's fast path and its direct steps (its decoding
# loop calls transformers' generation internals, which move between versions; direct steps build the model's
# output class) and the reach of ordinary calls and families. Run after install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=$(python -c "import re; print(re.search(r'transformers>=([0-9.]+)', open('pyproject.toml').read()).group(1))")
VENV=${KVPASS_FLOOR_VENV:-/tmp/kvpass-transformers-$FLOOR}
if [ ! -x "$VENV/bin/python" ]; then
    # the packages of the Python that runs this script (a virtual environment's too, which --system-site-packages
    # would skip for the base interpreter's), after the floor environment's own
    python -m venv "$VENV"
    PARENT=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "import site; site.addsitedir('$PARENT')" >"$SITE/kvpass-parent.pth"
fi
LOG=$(mktemp)
TORCH_FLOOR=2.13.0
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "transformers==$FLOOR" "torch==$TORCH_FLOOR" \
    "triton==3.6.0; platform_system == 'Linux'" >"$LOG" 2>&1 \
    || { cat "$LOG"; echo "ci/floor.sh: could not install transformers==$FLOOR torch==$TORCH_FLOOR"; exit 1; }
# the venv must really see the floor, not the newest transformers it shares the site-packages with
"$VENV/bin/python" -c "import sys, transformers, torch; print('floor: transformers', transformers.__version__, 'torch',
torch.__version__); sys.exit(transformers.__version__ != '$FLOOR' or torch.__version__.split('+')[0] != '$TORCH_FLOOR')"
# Left to the main run (CI time): Inductor-marked tests (Inductor lowers the graph kvpass hands it, which the eager
# and aot_eager tests here check on this transformers' graphs); in the equivalence matrix the StaticCache half and
# eager attention (every family runs here with SDPA, gemma2, which has no SDPA, with eager); Gemma-3-270M's real
# weights, and SmolLM2's compile and explain (its load and conversion run here; the tiny families run every
# check); the 100-call and recompile-budget runs of test_reach (they count Dynamo's guards); test_streaming's hand
# references (streamingllm's eviction on the graphs test_eviction_models and test_hostile check here); the records
# kvpass keeps across calls (test_hostile's caches decoded in turn and bare forwards after generate: kvpass's own
# bookkeeping, whose cache calls every test here makes); of the fast path's graphs per prompt length, full, snapkv,
# h2o (scores kept in the cache) and asl_2pass (two passes): the other policies' operators are the same code on
# every version, the graphs and guards are what change
SKIP="-static or (-eager- and not gemma2) or gemma3-270m or gemma3_full_policy"
SKIP="$SKIP or in_turn_each_continue or bare_forward_after_generate"
SKIP="$SKIP or (every_prompt_length and not (full or snapkv or h2o or asl_2pass))"
SKIP="$SKIP or full_policy_compiled_equals_uncompiled or explain_shows_every_layer"
SKIP="$SKIP or hundred_ordinary_calls or do_not_share_a_recompile_budget"
"$VENV/bin/python" -m pytest -q -n auto -p no:cacheprovider -m "not inductor" -k "not ($SKIP)" \
    tests/test_models.py tests/test_equivalence.py \
    tests/test_eviction_models.py tests/test_hostile.py \
    tests/test_fastpath.py tests/test_fastpath_options.py tests/test_direct_steps.py tests/test_reach.py \
    tests/test_family_sweep.py tests/test_kvzip.py
