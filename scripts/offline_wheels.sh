#!/usr/bin/env bash
# Download, into ./.whl (git-ignored), the wheels that an offline GPU machine with Python 3.12 and torch
# already installed lacks: the project's non-torch runtime dependencies. Copy the checkout with .whl/ to
# the machine and install them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# (benchmarks/gpu_session.sh does this first).
# Usage: scripts/offline_wheels.sh [PACKAGE==VERSION ...]   (default: the pinned runtime dependencies)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
pkgs=("$@")
if [ ${#pkgs[@]} -eq 0 ]; then
  # (+ what k2-train imports that the GPU machine lacks: PyYAML for omegaconf, psutil, xxhash for the
  # checkpoint manifest, tokenizers, tqdm)
  pkgs=(megatron-core==0.19.2 emerging-optimizers==0.3.0 hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
        PyYAML==6.0.4 psutil==7.2.2 xxhash==4.1.0 tokenizers==0.23.3 tqdm==4.70.1)
fi
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pkgs[@]}"
du -sh .whl
