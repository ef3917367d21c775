#!/usr/bin/env bash
# A hash of the code a GPU run executes (kvpass/, bench/, tests/gpu/), from the repository root: gpu_run.sh writes it
# into machine.txt, and the same command on the development machine says which tree the results came from.
find kvpass bench tests/gpu -type f \( -name '*.py' -o -name '*.sh' \) -not -path '*/__pycache__/*' | LC_ALL=C sort |
  xargs sha1sum | sha1sum | cut -c 1-12
