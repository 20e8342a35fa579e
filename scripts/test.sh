#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs the whole test suite with ctest. GPU tests skip
# themselves on a machine without a GPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

build
cd "$BUILD_DIR"
# Tests run in parallel and the CPU reference uses OpenMP: idle threads should sleep, not spin.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
ctest --output-on-failure -j "${TEST_JOBS:-$(nproc)}"
