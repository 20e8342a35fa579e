#!/usr/bin/env bash
# Two builds of the trainer timed against each other on the GPU machine, alternated run by run (A B A B)
# so that both see the same card state: single `coda bench` runs of one binary spread by 2-5 ms, and the
# card's clock moves with its power draw. Runs `bench_programs` (both models, each CODA program's GEMM
# kernel) and `coda bench` (gpt2-124m B=32 T=1024, llama3.2-1b B=8 T=2048, both modes in one process),
# twice per build, and prints one table of every run last.
#
#   scripts/compare_builds.sh DIR_A DIR_B    directories that hold the coda and bench_programs binaries
#   COMPARE_RUNS=N                           bench_programs timed runs per program (default 15)
# Logs go to $OUT when it is set, else to compare_logs/. Exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ $# -ne 2 || ! -x "$1/coda" || ! -x "$1/bench_programs" || ! -x "$2/coda" || ! -x "$2/bench_programs" ]]; then
  echo "usage: scripts/compare_builds.sh DIR_A DIR_B  (each holding coda and bench_programs)" >&2
  exit 2
fi
declare -A dirs=([a]="$1" [b]="$2")
logs=${OUT:-compare_logs}
mkdir -p "$logs"
runs=${COMPARE_RUNS:-15}
status=0
models=("gpt2-124m 32 1024" "llama3.2-1b 8 2048")

for round in 1 2; do
  for side in a b; do
    dir=${dirs[$side]}
    for model in gpt2 llama; do
      echo "== bench_programs --model $model, build $side, run $round"
      "$dir/bench_programs" --model "$model" --runs "$runs" >"$logs/programs_${model}_$side$round.log" 2>&1 || status=1
    done
    for m in "${models[@]}"; do
      read -r name batch seq <<<"$m"
      echo "== coda bench $name, build $side, run $round"
      "$dir/coda" bench --config "configs/$name.toml" --batch_size "$batch" --seq_len "$seq" --warmup 3 --steps 10 \
        >"$logs/step_${name}_$side$round.log" 2>&1 || status=1
    done
  done
done

# One row per program (its CODA time in us) and per model and mode (median ms per step); columns A1 B1
# A2 B2 in the order they ran.
echo
echo "A = $1, B = $2"
echo "| what | A run 1 | B run 1 | A run 2 | B run 2 |"
echo "|---|---|---|---|---|"
for model in gpt2 llama; do
  awk -F'|' -v tag="$model" '
    FNR == 1 { file++ }
    $2 ~ "^ " tag " " { name = $2; gsub(/^ +| +$/, "", name); if (!(name in seen)) { seen[name] = 1; order[++n] = name }
                        t[name, file] = $5 + 0 }
    END { for (i = 1; i <= n; i++) printf "| %s | %s | %s | %s | %s |\n", order[i], t[order[i], 1], t[order[i], 2],
                                           t[order[i], 3], t[order[i], 4] }' \
    "$logs/programs_${model}_a1.log" "$logs/programs_${model}_b1.log" "$logs/programs_${model}_a2.log" \
    "$logs/programs_${model}_b2.log"
done
for m in "${models[@]}"; do
  read -r name _ <<<"$m"
  for mode in cuda-unfused cuda-coda; do
    row="| $name $mode ms/step |"
    for run in a1 b1 a2 b2; do
      row+=" $(awk -v mode="$mode" '$1 == mode { print $2 }' "$logs/step_${name}_$run.log") |"
    done
    echo "$row"
  done
done
exit $status
