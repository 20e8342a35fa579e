#!/usr/bin/env bash
# The demo: installs what is missing, builds, prepares the built-in synthetic data if it is not there
# yet, and trains a config (default configs/tiny-gpt2.toml) on the GPU when nvidia-smi sees one, else on
# the CPU. Usage: scripts/run.sh [CONFIG] [extra `coda train` flags...]
# Each call writes a new run directory, runs/<config name>-<date-time>, unless --out is given.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

config="${1:-configs/tiny-gpt2.toml}"
[ $# -gt 0 ] && shift
cd "$ROOT"
build --target coda
# The CPU reference's OpenMP threads sleep between parallel regions instead of spinning.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

if ! compgen -G "data/synthetic/train_*.bin" >/dev/null; then
  "$BUILD_DIR/coda" prepare synthetic --out data/synthetic
fi

device=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then device=cuda; fi
out="runs/$(basename "$config" .toml)-$(date +%Y%m%d-%H%M%S)"
echo "training $config on $device into $out"
exec "$BUILD_DIR/coda" train --config "$config" --device "$device" --out "$out" "$@"
