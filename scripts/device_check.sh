#!/usr/bin/env bash
# The GPU check, in one go on a machine with an NVIDIA Hopper GPU: build with all cores (benchmarks and
# every GEMM tile on), the GPU tests (also under mpirun -np 1), `coda bench` and the CODA_PROFILE=1 kernel
# profile (with the fusion bound) of both modes on gpt2-124m, llama3.2-1b and qwen2.5-0.5b (the bench with
# each mode's deterministic variant, the FP8 unfused mode with per-tensor, block and mixed scales and with the
# LM head in FP8 too, and the coda mode with CODA_BARE_GEMMS=handwritten),
# a ZeRO-1 run against the plain one, tiny-qwen2 trained in both modes,
# tiny-llama trained in bf16 and fp8, the FP8 GEMMs against cuBLASLt's, and `coda train` of gpt2-124m
# against its bench step; then a summary table (the last output lines).
#   scripts/device_check.sh [BUILD_DIR]     build in BUILD_DIR (default: build/) and run
#   CODA_PREBUILT=DIR scripts/device_check.sh   skip the build, run the binaries in DIR
#   CODA_CHECK_BENCH_KERNELS=1              also run the unfused-kernel and CODA-pass benchmarks
#   CODA_CHECK_PROGRAMS=1                   also run bench_programs (each program against its chain, in time and
#                                           in joules: the epilogue's against the removed kernels'; ~4 min)
#   CODA_CHECK_PROGRAMS=tiles               the same with each program on every tile (--tiles; ~12 min)
# Logs and the bench JSON go to BUILD_DIR/check-logs, and into $OUT/check-logs.tar.gz as well when OUT
# is set. The script keeps going after a failed step and exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

build=${1:-build}
bin=${CODA_PREBUILT:-$build}
logs=$build/check-logs
mkdir -p "$logs"
archive_logs() { if [[ -n "${OUT:-}" ]]; then tar czf "$OUT/check-logs.tar.gz" -C "$build" check-logs; fi; }
status=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
targets=(coda gpu_tests bench_programs bench_gemm)
[[ -n "${CODA_CHECK_BENCH_KERNELS:-}" ]] && targets+=(bench_unfused_kernels bench_passes)

if [[ -z "${CODA_PREBUILT:-}" ]]; then
  echo "== build ($build, $(nproc) cores)"
  start=$(date +%s)
  if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCODA_BENCHMARKS=ON -DCODA_ALL_TILES=ON \
           >"$logs/configure.log" &&
         cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >"$logs/build.log"; }; then
    grep -E "error|FAILED" "$logs/build.log" | head -n 30
    echo "build failed"
    archive_logs
    exit 1
  fi
  echo "built in $(( $(date +%s) - start )) s"
fi

echo "== GPU tests"
"$bin/gpu_tests" --gtest_color=no >"$logs/gpu_tests.log" 2>&1 || status=1
grep -E '^\[  FAILED|^\[  PASSED|tests ran' "$logs/gpu_tests.log"
echo "== GPU tests under mpirun -np 1 (communicator, ZeRO-1)"
mpirun -np 1 "$bin/gpu_tests" --gtest_color=no --gtest_filter='Communicator.*:Zero*' >"$logs/gpu_tests_mpi.log" 2>&1 || status=1
grep -E '^\[  FAILED|^\[  PASSED' "$logs/gpu_tests_mpi.log"

echo "== FP8 GEMMs against cuBLASLt FP8 (bench_gemm --fp8 --quick)"
"$bin/bench_gemm" --fp8 --quick >"$logs/bench_gemm_fp8.log" 2>&1 || status=1
grep -E "worst" "$logs/bench_gemm_fp8.log"

if [[ -n "${CODA_CHECK_BENCH_KERNELS:-}" ]]; then
  "$bin/bench_unfused_kernels" >"$logs/bench_kernels.log" 2>&1 || status=1
  "$bin/bench_passes" >"$logs/bench_passes.log" 2>&1 || status=1
fi

if [[ -n "${CODA_CHECK_PROGRAMS:-}" ]]; then
  tiles=$([[ $CODA_CHECK_PROGRAMS == tiles ]] && echo --tiles || true)
  echo "== CODA programs against their unfused chains (bench_programs --runs 10 $tiles)"
  "$bin/bench_programs" --runs 10 $tiles >"$logs/bench_programs.log" 2>&1 || status=1
  grep -E '^\| (program|gpt2|llama)' "$logs/bench_programs.log"
fi

bench() {  # name config B T FP8_RECIPES (timed beside per-tensor scaling: an fp8_scaling, "+head" for the LM head too)
  echo "== coda bench $1 (B=$3, T=$4)"
  timed() {  # log name, config, B, T, then more flags: 30 timed steps, the JSON beside the log
    local out=$1 config=$2 batch=$3 seq=$4
    shift 4
    "$bin/coda" bench --config "$config" --batch_size "$batch" --seq_len "$seq" --warmup 3 --steps 30 "$@" \
      --json "$logs/$out.json" >"$logs/$out.log" 2>&1 || status=1
  }
  timed "bench_$1" "$2" "$3" "$4" --deterministic
  timed "bench_$1_fp8" "$2" "$3" "$4" --kernels unfused --precision fp8
  for recipe in $5; do
    local scaling=${recipe%+head} linears=qkv,attn_proj,mlp_up,mlp_down
    [[ $recipe == *+head ]] && linears+=,lm_head
    timed "bench_$1_fp8_$recipe" "$2" "$3" "$4" --kernels unfused --precision fp8 --fp8_scaling "$scaling" \
      --fp8_linears "$linears"
  done
  CODA_BARE_GEMMS=handwritten timed "bench_$1_bare_handwritten" "$2" "$3" "$4" --kernels coda
  for mode in coda unfused; do
    CODA_PROFILE=1 "$bin/coda" bench --config "$2" --batch_size "$3" --seq_len "$4" --warmup 30 --steps 2 \
      --energy_seconds 0 --kernels $mode >"$logs/profile_$1_$mode.log" 2>&1 || status=1
  done
}
bench gpt2-124m configs/gpt2-124m.toml 32 1024 "block tensor+head"
bench llama3.2-1b configs/llama3.2-1b.toml 8 2048 "block mlp_down mlp_down+head"
bench qwen2.5-0.5b configs/qwen2.5-0.5b.toml 16 2048 block

echo "== ZeRO-1 training run against the plain one (tiny-gpt2, 40 steps, mpirun -np 1)"
data=$(mktemp -d)
"$bin/coda" prepare synthetic --out "$data/synthetic" >"$logs/prepare.log" 2>&1 || status=1
for mode in plain zero1; do
  flag=$([[ $mode == zero1 ]] && echo --zero1 || true)
  mpirun -np 1 "$bin/coda" train --config configs/tiny-gpt2.toml --device cuda --steps 40 \
    --train_data "$data/synthetic/train_*.bin" --val_data "$data/synthetic/val_*.bin" $flag --out "$data/$mode" >"$logs/train_$mode.log" 2>&1 || status=1
done
echo "== tiny-qwen2 (QKV bias) trained in both GPU modes, 100 steps"
for mode in unfused coda; do
  "$bin/coda" train --config configs/tiny-qwen2.toml --device cuda --kernels $mode --steps 100 --val_every 0 \
    --train_data "$data/synthetic/train_*.bin" --val_data "$data/synthetic/val_*.bin" --out "$data/qwen2_$mode" \
    >"$logs/train_qwen2_$mode.log" 2>&1 || status=1
done
qwen2_losses=$(python3 - "$data" <<'PY' 2>/dev/null || echo "no result"
import json, sys
last = {m: [json.loads(l) for l in open(f"{sys.argv[1]}/qwen2_{m}/metrics.jsonl")][-1]["loss"] for m in ("unfused", "coda")}
print(f"final loss unfused {last['unfused']:.4f}, coda {last['coda']:.4f} (entropy rate 1.386)")
PY
)
echo "== tiny-llama trained in bf16 and fp8 (unfused mode), 200 steps"
for precision in bf16 fp8; do
  "$bin/coda" train --config configs/tiny-llama.toml --device cuda --kernels unfused --precision $precision \
    --steps 200 --val_every 200 --train_data "$data/synthetic/train_*.bin" --val_data "$data/synthetic/val_*.bin" \
    --out "$data/llama_$precision" >"$logs/train_llama_$precision.log" 2>&1 || status=1
done
fp8_losses=$(python3 - "$data" <<'PY' 2>/dev/null || echo "no result"
import json, sys
val = {p: [r["val_loss"] for r in map(json.loads, open(f"{sys.argv[1]}/llama_{p}/metrics.jsonl")) if "val_loss" in r][-1]
       for p in ("bf16", "fp8")}
print(f"val loss bf16 {val['bf16']:.4f}, fp8 {val['fp8']:.4f} (fp8 / bf16 {val['fp8'] / val['bf16']:.4f})")
PY
)
echo "== coda train against coda bench (gpt2-124m, B=32, T=1024, 40 steps on the synthetic corpus)"
"$bin/coda" train --config configs/gpt2-124m.toml --device cuda --steps 40 --log_every 10 --val_every 0 \
  --train_data "$data/synthetic/train_*.bin" --val_data "$data/synthetic/val_*.bin" --out "$data/train_gpt2" \
  >"$logs/train_gpt2.log" 2>&1 || status=1
train_vs_bench=$(python3 scripts/train_vs_bench.py "$data/train_gpt2/metrics.jsonl" "$logs/bench_gpt2-124m.json" \
  2>/dev/null || echo "no result")
zero1_same=$(python3 - "$data" <<'PY' 2>/dev/null || echo "no result"
import json, sys
records = [[json.loads(l) for l in open(f"{sys.argv[1]}/{m}/metrics.jsonl")] for m in ("plain", "zero1")]
losses = [[r["loss"] for r in rs if "loss" in r] for rs in records]
print(f"{len(losses[0])} steps, max |zero1 - plain| loss {max(abs(a - b) for a, b in zip(*losses)):.3g}")
PY
)

echo
echo "== summary ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
count() { grep -c "$1" "$2" 2>/dev/null || true; }
printf '%-28s %s passed, %s failed, %s skipped\n' "GPU tests" "$(count '^\[       OK \]' "$logs/gpu_tests.log")" \
  "$(count '^\[  FAILED  \].*ms)' "$logs/gpu_tests.log")" "$(count '^\[  SKIPPED \]' "$logs/gpu_tests.log")"
printf '%-28s %s passed, %s failed\n' "GPU tests, mpirun -np 1" "$(count '^\[       OK \]' "$logs/gpu_tests_mpi.log")" \
  "$(count '^\[  FAILED  \].*ms)' "$logs/gpu_tests_mpi.log")"
printf '%-28s %s\n' "ZeRO-1 vs plain (tiny-gpt2)" "$zero1_same"
printf '%-28s %s\n' "coda train vs bench, gpt2" "$train_vs_bench"
printf '%-28s %s\n' "tiny-qwen2, 100 steps" "$qwen2_losses"
printf '%-28s %s\n' "tiny-llama fp8, 200 steps" "$fp8_losses"
printf '%-28s %s\n' "FP8 GEMM vs cuBLASLt FP8" "$(grep -o 'worst auto/cublas FP8 ratio: [0-9.]*' "$logs/bench_gemm_fp8.log" || echo "no result")"
for name in gpt2-124m llama3.2-1b qwen2.5-0.5b; do  # the unfused profile's share of epilogue operations, and the bound
  bound=$(grep -o 'at most [0-9.]*x' "$logs/profile_${name}_unfused.log" 2>/dev/null || echo "no profile")
  printf '%-28s %s\n' "fusion bound, $name" "$bound faster than unfused (free epilogues, same GEMMs and attention)"
done
printf '%-14s %-28s %9s %9s %7s %8s %8s %7s %7s %9s %8s\n' model backend "ms/step" "tokens/s" MFU "fwd ms" "bwd ms" \
  "J/step" "SM MHz" "tokens/J" anchor
for run in gpt2-124m:62.65 llama3.2-1b:242 qwen2.5-0.5b:-; do
  name=${run%%:*} anchor=${run##*:}
  python3 - "$logs/bench_$name.json" "$logs/bench_${name}_bare_handwritten.json" "$name" "$anchor" \
    "$logs/bench_${name}_fp8"*.json <<'PY'
import json, sys
bf16, bare, name, anchor, *fp8_runs = sys.argv[1:]
def fig(value, spec):
    return format(value, spec) if value else "-"
def rows(path, keep):
    try:
        return [r for r in json.load(open(path)) if keep(r)]
    except OSError:
        print(f"{name}: no bench result in {path}")
        return []
bare_rows = rows(bare, lambda r: True)
for r in bare_rows:
    r["backend"] += " bare-handwritten"
fp8_rows = lambda r: "fp8" in r["backend"]
for r in rows(bf16, lambda r: True) + [r for path in fp8_runs for r in rows(path, fp8_rows)] + bare_rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get('mfu') else "-"
    print(f"{name:<14} {r['backend']:<28} {r['median_ms']:9.2f} {r['tokens_per_s']:9.0f} {mfu:>7} "
          f"{fig(r['forward_ms'], '8.2f'):>8} {fig(r['backward_ms'], '8.2f'):>8} {fig(r['joules_per_step'], '7.2f'):>7} "
          f"{fig(r['mean_sm_clock_mhz'], '7.0f'):>7} {fig(r['tokens_per_joule'], '9.0f'):>9} {anchor:>8}")
PY
done
echo "(anchor: PyTorch + torch.compile ms/step on one H200, docs/PERFORMANCE.md)"
archive_logs
exit $status
