#!/usr/bin/env bash
# The GPU check, in one go on a machine with an NVIDIA Hopper GPU: build with all cores, run the GPU
# tests, the unfused kernel benchmark and `coda bench` on gpt2-124m (B=32, T=1024) and llama3.2-1b
# (B=8, T=2048) with a short schedule, then print a summary table (the last lines of the output).
#
#   scripts/device_check.sh [BUILD_DIR]     build in BUILD_DIR (default: build/) and run
#   CODA_PREBUILT=DIR scripts/device_check.sh   skip the build, run the binaries in DIR (for a machine
#                                               without the build dependencies; copy the binaries there)
# Logs and the bench JSON go to $OUT when it is set, else to the build directory. The script keeps going
# after a failed step and exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

build=${1:-build}
bin=${CODA_PREBUILT:-$build}
logs=${OUT:-$build}
mkdir -p "$logs"
status=0

if [[ -z "${CODA_PREBUILT:-}" ]]; then
  echo "== build ($build, $(nproc) cores)"
  if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$logs/configure.log" &&
         cmake --build "$build" -j"$(nproc)" --target coda gpu_tests bench_unfused_kernels >"$logs/build.log"; }; then
    tail -n 30 "$logs/configure.log" "$logs/build.log" 2>/dev/null
    echo "build failed"
    exit 1
  fi
fi

echo "== GPU tests"
"$bin/gpu_tests" 2>&1 | tee "$logs/gpu_tests.log" || status=1

echo "== unfused kernel benchmark"
"$bin/bench_unfused_kernels" 2>&1 | tee "$logs/bench_kernels.log" || status=1

bench() {  # name config B T
  echo "== coda bench $1 (B=$3, T=$4)"
  "$bin/coda" bench --config "$2" --batch_size "$3" --seq_len "$4" --warmup 3 --steps 10 \
    --json "$logs/bench_$1.json" 2>&1 | tee "$logs/bench_$1.log" || status=1
}
bench gpt2-124m configs/gpt2-124m.toml 32 1024
bench llama3.2-1b configs/llama3.2-1b.toml 8 2048

echo
echo "== summary ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
passed=$(grep -c '^\[       OK \]' "$logs/gpu_tests.log" || true)
failed=$(grep -c '^\[  FAILED  \].*ms)' "$logs/gpu_tests.log" || true)
skipped=$(grep -c '^\[  SKIPPED \]' "$logs/gpu_tests.log" || true)
printf '%-28s %s\n' "GPU tests" "$passed passed, $failed failed, $skipped skipped"
slow=$(grep -c '^  \* ' "$logs/bench_kernels.log" || true)
total=$(grep -c '^    \|^  \* ' "$logs/bench_kernels.log" || true)
printf '%-28s %s\n' "kernels under 80% of 4.2TB/s" "$slow (of $total rows incl. the copy)"
grep '^  \* ' "$logs/bench_kernels.log" || true
printf '%-14s %-16s %10s %10s %7s %8s %8s %8s %8s\n' model backend "ms/step" "tokens/s" MFU "fwd ms" "bwd ms" "opt ms" anchor
for run in gpt2-124m:87.7 llama3.2-1b:341; do
  name=${run%%:*} anchor=${run##*:}
  python3 - "$logs/bench_$name.json" "$name" "$anchor" <<'EOF' || echo "$name: no bench result"
import json, sys
path, name, anchor = sys.argv[1], sys.argv[2], float(sys.argv[3])
for r in json.load(open(path)):
    mfu = f"{100 * r['mfu']:.1f}%" if r.get('mfu') else "-"
    print(f"{name:<14} {r['backend']:<16} {r['median_ms']:10.2f} {r['tokens_per_s']:10.0f} {mfu:>7} "
          f"{r['forward_ms']:8.2f} {r['backward_ms']:8.2f} {r['optimizer_ms']:8.2f} {anchor:8.1f}")
EOF
done
exit $status
