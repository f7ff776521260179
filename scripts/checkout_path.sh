#!/usr/bin/env bash
# Print a directory that makes this checkout importable as the `k2` namespace without installing it
# (for machines where `pip install -e .` is not possible, e.g. the GPU device, which has no network):
# DIR/k2/<package> are symlinks to the checkout's config/, parallel/, model/, schedules/, optim/,
# launcher/ and recipes/, as pyproject.toml's package-dir maps them. Usage:
#   export PYTHONPATH="$(bash scripts/checkout_path.sh):$PYTHONPATH"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${TMPDIR:-/tmp}/k2-checkout-$(printf '%s' "$root" | cksum | cut -d' ' -f1)"
mkdir -p "$dir/k2"
for pkg in config parallel model schedules optim launcher recipes; do
  ln -sfn "$root/$pkg" "$dir/k2/$pkg"
done
echo "$dir"
