#!/usr/bin/env bash
# Run several GPU jobs at once, one per GPU, each under a time limit, and pack their results.
#   bash bench/calls/lanes.sh OUT SECONDS 'command for GPU 0' 'command for GPU 1' ...
# Lane i runs with CUDA_VISIBLE_DEVICES=i and LANE set to a scratch folder for its result files;
# its stdout and stderr go to OUT/lane<i>.log. A command may hold several jobs joined by ';', which
# then share the GPU. When every lane has ended (or hit its limit), OUT/lanes.tgz packs the lane
# folders (lane<i>/...), so OUT holds few files however many each lane writes.
# Timings from different lanes come from different GPUs of one machine: compare ratios within a lane.
set -u
out=${1:?output folder}; limit=${2:?seconds per lane}; shift 2
mkdir -p "$out"
work=$(mktemp -d)
i=0
for cmd in "$@"; do
  mkdir -p "$work/lane$i"
  CUDA_VISIBLE_DEVICES=$i LANE="$work/lane$i" timeout -k 10 "$limit" bash -c "$cmd" > "$out/lane$i.log" 2>&1 &
  i=$((i + 1))
done
wait
tar czf "$out/lanes.tgz" -C "$work" .
for f in "$out"/lane*.log; do echo "== $f"; tail -n 4 "$f"; done
