#!/usr/bin/env bash
# Two builds of the trainer timed against each other on the GPU machine, alternated run by run (A B A B) so
# that both see the same card state (single runs spread by 2-5 ms; the clock follows the power draw); two
# rounds per build, then one table of every run. Parts: programs (bench_programs, us and mJ per program),
# gemm (bench_gemm --quick, ratio to cuBLASLt), step (coda bench of gpt2-124m and llama3.2-1b, both modes:
# ms and joules over 30 timed steps, as the energy counter needs a few seconds).
#   scripts/compare_builds.sh DIR_A DIR_B    directories that hold the binaries of each build
#   COMPARE_PARTS="programs step"            the parts to run (default all three)
#   COMPARE_RUNS=N                           bench_programs timed runs per program (default 15)
# Logs go to $OUT when it is set, else to compare_logs/. Exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."

parts=${COMPARE_PARTS:-programs gemm step}
need=()
[[ $parts == *programs* ]] && need+=(bench_programs)
[[ $parts == *gemm* ]] && need+=(bench_gemm)
[[ $parts == *step* ]] && need+=(coda)
usage() { echo "usage: scripts/compare_builds.sh DIR_A DIR_B  (each holding ${need[*]})" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
for dir in "$1" "$2"; do
  for binary in "${need[@]}"; do [[ -x $dir/$binary ]] || usage; done
done
declare -A dirs=([a]="$1" [b]="$2")
logs=${OUT:-compare_logs}
mkdir -p "$logs"
runs=${COMPARE_RUNS:-15}
status=0
models=("gpt2-124m 32 1024" "llama3.2-1b 8 2048")

for round in 1 2; do
  for side in a b; do
    dir=${dirs[$side]}
    if [[ $parts == *programs* ]]; then
      for model in gpt2 llama; do
        echo "== bench_programs --model $model, build $side, run $round"
        "$dir/bench_programs" --model "$model" --runs "$runs" >"$logs/programs_${model}_$side$round.log" 2>&1 || status=1
      done
    fi
    if [[ $parts == *gemm* ]]; then
      echo "== bench_gemm --quick, build $side, run $round"
      "$dir/bench_gemm" --quick >"$logs/gemm_$side$round.log" 2>&1 || status=1
    fi
    if [[ $parts == *step* ]]; then
      for m in "${models[@]}"; do
        read -r name batch seq <<<"$m"
        echo "== coda bench $name, build $side, run $round"
        "$dir/coda" bench --config "configs/$name.toml" --batch_size "$batch" --seq_len "$seq" --warmup 3 --steps 30 \
          >"$logs/step_${name}_$side$round.log" 2>&1 || status=1
      done
    fi
  done
done

# Columns A1 B1 A2 B2 in the order the runs ran.
echo
echo "A = $1, B = $2"
echo "| what | A run 1 | B run 1 | A run 2 | B run 2 |"
echo "|---|---|---|---|---|"
table() {  # an awk program printing "name<TAB>value" lines of one log, then the four logs (A1 B1 A2 B2)
  local program=$1 i=0 log
  shift
  for log in "$@"; do
    i=$((i + 1))
    awk -F'|' -v OFS='\t' "$program" "$log" | sed "s/^/$i\t/"
  done | awk -F'\t' '
    { if (!($2 in seen)) { seen[$2] = 1; order[++n] = $2 } v[$2, $1] = $3 }
    END { for (i = 1; i <= n; i++) printf "| %s | %s | %s | %s | %s |\n", order[i], v[order[i], 1], v[order[i], 2],
                                               v[order[i], 3], v[order[i], 4] }'
}
logs4() { echo "$logs/$1_a1.log" "$logs/$1_b1.log" "$logs/$1_a2.log" "$logs/$1_b2.log"; }
if [[ $parts == *programs* ]]; then
  for model in gpt2 llama; do
    # shellcheck disable=SC2046 # four log paths
    table '$2 ~ /^ (gpt2|llama) / { n = $2; gsub(/^ +| +$/, "", n); print n " us", $5 + 0; print n " mJ", $11 + 0 }' \
      $(logs4 "programs_$model")
  done
fi
if [[ $parts == *gemm* ]]; then
  # shellcheck disable=SC2046
  table 'NF == 4 && $1 ~ /^(gpt2|llama) / { n = $1; gsub(/ +/, " ", n); split($3, r, " "); print n "auto/cuBLASLt", r[2] }' \
    $(logs4 gemm)
fi
if [[ $parts == *step* ]]; then
  for m in "${models[@]}"; do
    read -r name _ <<<"$m"
    # shellcheck disable=SC2046
    table '{ split($0, f, " ") } f[1] ~ /^cuda-/ { print "'"$name"' " f[1] " ms/step", f[2]; print "'"$name"' " f[1] " J/step", f[10] }' \
      $(logs4 "step_$name")
  done
fi
exit $status
