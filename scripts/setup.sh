#!/usr/bin/env bash
# Shared by run.sh and test.sh (sourced, not run): installs the Debian packages the build needs when
# any is missing (ccache too: CMake uses it when it is there), checks for the CUDA toolkit and NCCL (they
# come with the machine, not from Debian), and builds with CMake + Ninja in build/ (BUILD_DIR overrides;
# BUILD_JOBS caps parallelism; CODA_CMAKE_ARGS adds configure options, e.g. -DCODA_BENCHMARKS=ON).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"

install_missing_packages() {
  # Tools count as present when they are on PATH (however they were installed), libraries when dpkg has
  # them. libopenmpi-dev is only needed to launch with mpirun (the build works without MPI).
  local missing=()
  local tool
  for tool in cmake:cmake ninja:ninja-build g++:g++ ccache:ccache; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
  done
  local package
  for package in libcli11-dev libspdlog-dev nlohmann-json3-dev libgtest-dev libopenmpi-dev; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing missing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

find_cuda() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if ! command -v nvcc >/dev/null 2>&1; then
    echo "error: nvcc not found: install the CUDA toolkit (12.4 or newer, for sm_90a) and put nvcc on PATH" >&2
    exit 1
  fi
}

build() {
  install_missing_packages
  find_cuda
  # shellcheck disable=SC2086 # CODA_CMAKE_ARGS is a list of options
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CODA_CMAKE_ARGS:-} >/dev/null
  cmake --build "$BUILD_DIR" -j "${BUILD_JOBS:-$(nproc)}" "$@"
}
