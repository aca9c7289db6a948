#!/usr/bin/env bash
# Wheels for a GPU machine without internet whose image lacks `datasets` and `evaluate` (see benchmarks/README.md).
# Fills .whl/ (git-ignored) with them, the two packages of theirs such images lack (dill, multiprocess), TRL (the
# causal-LM peer of sft_peer.py), peft at the version the project is tested with, and py-spy (gpu_benchmark.py
# --diagnose), ~5.5 MB.
# Install them into a folder whose path holds `site-packages` (benchmarks/README.md says why).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2 trl==1.16.0 py-spy==0.4.3 "$@"
ls -l .whl
