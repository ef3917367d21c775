#!/usr/bin/env bash
# The wheels that case K of bench/calls/decode_calls.sh carries to the GPU machine in .whl/: kvpress 0.5.5 needs
# transformers < 5.3 (5.2.0), and transformers 5.2 needs tokenizers <= 0.23.0 (0.22.2); datasets, dill,
# multiprocess, cachetools, fire and termcolor are imported by kvpress. The GPU machine (Python 3.12,
# x86-64) has the rest. fire 0.6.0 has only an sdist: it is built into a wheel here (pure Python).
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
plat="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: $plat -d .whl kvpress==0.5.5 transformers==5.2.0 \
  tokenizers==0.22.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 cachetools==5.5.2 termcolor==3.3.0
python3 -m pip wheel -q --no-deps -w .whl fire==0.6.0
ls -la .whl
