#!/usr/bin/env bash
# The multi-GPU check on a machine with N >= 2 GPUs, mpirun over N ranks against one rank (coda mode),
# ending in a summary table (docs/DISTRIBUTED.md, "Checks on several GPUs", explains the limits):
#  loss     20 steps of gpt2-124m and llama3.2-1b, three times on one GPU, on N GPUs and on N GPUs with
#           ZeRO-1, the same global batches; limit max(0.01, 2 x the one-GPU runs' largest difference);
#  resume   the N-GPU run's step-10 checkpoint continued on one GPU and the reverse, against the
#           uninterrupted runs' steps 11-20;
#  scaling  `coda bench --kernels coda` at the same per-GPU batch on 1 and N ranks, plain and ZeRO-1.
#   scripts/multi_gpu_check.sh [BIN_DIR]   binaries from BIN_DIR (default build/; build the target coda)
#   CODA_GPUS=N  CODA_CHECK_MODELS="gpt2-124m ..."  CODA_CHECK_PARTS="loss resume scaling" (resume needs loss)
# Logs go to $OUT when it is set, else to a temporary directory. Exits non-zero if a step failed or a
# check missed its limit.
set -uo pipefail
cd "$(dirname "$0")/.."

bin=${1:-build}
[[ -x "$bin/coda" ]] || { echo "no $bin/coda: build it first (cmake --build $bin --target coda)"; exit 1; }
gpus=${CODA_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
(( gpus >= 2 )) || { echo "needs at least 2 GPUs, found $gpus"; exit 1; }
logs=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
status=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
echo "== $gpus GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); logs in $logs"
nvidia-smi topo -m > "$logs/topology.txt" 2>&1 || true

"$bin/coda" prepare synthetic --out "$work/data" --train_tokens 20000000 >"$logs/prepare.log" 2>&1 || status=1
data=(--train_data "$work/data/train_*.bin" --val_data "$work/data/val_*.bin" --val_every 0)

train() {  # name ranks config batch_size out [extra flags...]
  local name=$1 ranks=$2 config=$3 batch=$4 out=$5
  shift 5
  echo "   train $name"
  mpirun -np "$ranks" "$bin/coda" train --config "$config" --device cuda --steps 20 --warmup_steps 20 \
    --batch_size "$batch" "${data[@]}" --out "$out" "$@" >"$logs/train_$name.log" 2>&1 || { status=1; tail -5 "$logs/train_$name.log"; }
}

models=${CODA_CHECK_MODELS:-gpt2-124m llama3.2-1b}
parts=${CODA_CHECK_PARTS:-loss resume scaling}
global_batch() { [[ $1 == llama* ]] && echo 8 || echo 32; }
seq_len() { [[ $1 == llama* ]] && echo 2048 || echo 1024; }

if [[ $parts == *loss* ]]; then
  echo "== loss over 20 steps: 1 GPU (three times) vs $gpus GPUs, same global batch"
  for model in $models; do
    global=$(global_batch "$model")
    every=$([[ $model == gpt2-124m ]] && echo 10 || echo 0)  # step 10: the resume part
    train "${model}_1gpu" 1 "configs/$model.toml" "$global" "$work/${model}_1gpu" --checkpoint_every "$every"
    train "${model}_1gpu_again" 1 "configs/$model.toml" "$global" "$work/${model}_1gpu_again"
    train "${model}_1gpu_third" 1 "configs/$model.toml" "$global" "$work/${model}_1gpu_third"
    train "${model}_${gpus}gpu" "$gpus" "configs/$model.toml" $((global / gpus)) "$work/${model}_${gpus}gpu" --checkpoint_every "$every"
    train "${model}_${gpus}gpu_zero1" "$gpus" "configs/$model.toml" $((global / gpus)) "$work/${model}_${gpus}gpu_zero1" --zero1
    rm -rf "$work/$model"_1gpu_again/step_* "$work/$model"_1gpu_third/step_* "$work/$model"_*zero1/step_* "$work"/llama3.2-1b_*/step_*  # llama: 15 GB each
  done
fi

if [[ $parts == *resume* ]]; then
  echo "== resume across world sizes (gpt2-124m, from step 10)"
  train "resume_${gpus}to1" 1 configs/gpt2-124m.toml 32 "$work/resume_${gpus}to1" --resume "$work/gpt2-124m_${gpus}gpu/step_10"
  train "resume_1to${gpus}" "$gpus" configs/gpt2-124m.toml $((32 / gpus)) "$work/resume_1to${gpus}" --resume "$work/gpt2-124m_1gpu/step_10"
fi

bench() {  # name ranks config B T [extra flags...]
  local name=$1 ranks=$2 config=$3 batch=$4 seq=$5
  shift 5
  echo "   bench $name"
  mpirun -np "$ranks" "$bin/coda" bench --config "$config" --kernels coda --batch_size "$batch" --seq_len "$seq" \
    --warmup 3 --steps 10 --json "$logs/bench_$name.json" "$@" >"$logs/bench_$name.log" 2>&1 || { status=1; tail -5 "$logs/bench_$name.log"; }
}
if [[ $parts == *scaling* ]]; then
  echo "== scaling: coda bench on 1 and $gpus ranks, same batch per GPU"
  for model in $models; do
    batch=$(global_batch "$model") seq=$(seq_len "$model")
    bench "${model}_1gpu" 1 "configs/$model.toml" "$batch" "$seq"
    bench "${model}_${gpus}gpu" "$gpus" "configs/$model.toml" "$batch" "$seq"
    bench "${model}_${gpus}gpu_zero1" "$gpus" "configs/$model.toml" "$batch" "$seq" --zero1
  done
fi

echo
echo "== summary ($(date -u +%F), $gpus x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
python3 - "$work" "$logs" "$gpus" "$models" "$parts" <<'PY' || status=1
import json, os, sys
work, logs, n, models, parts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(), sys.argv[5]
failed = False

def losses(run):
    path = f"{work}/{run}/metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))} if os.path.exists(path) else {}

def differences(a, b, steps):
    return [abs(a[s] - b[s]) if s in a and s in b else None for s in steps]

def compare(label, a, b, steps, limit):
    global failed
    diff = differences(a, b, steps)
    if None in diff:
        print(f"{label:<44} MISSING ({diff.count(None)} of {len(steps)} steps)")
        failed = True
        return
    ok = max(diff) <= limit
    failed |= not ok
    trace = " ".join(f"{d:.0e}" for d in diff[::3])
    print(f"{label:<44} max {max(diff):.2e} (limit {limit:.2e}) {'ok' if ok else 'FAIL'}  every 3rd step: {trace}")

if "loss" in parts:
    for model in models:
        one = losses(f"{model}_1gpu")
        steps = range(1, 21)
        singles = [one, losses(f"{model}_1gpu_again"), losses(f"{model}_1gpu_third")]
        pairs = [differences(a, b, steps) for i, a in enumerate(singles) for b in singles[i + 1:]]
        floor_trace = [max((p[k] for p in pairs if p[k] is not None), default=0.0) for k in range(len(steps))]
        limit = max(0.01, 2 * max(floor_trace))
        print(f"{model}: loss {one.get(1, float('nan')):.3f} -> {one.get(20, float('nan')):.3f} over 20 steps; "
              f"three 1-GPU runs differ by up to {max(floor_trace):.2e}")
        print(f"  {'1-GPU floor':<42} every 3rd step: " + " ".join(f"{d:.0e}" for d in floor_trace[::3]))
        compare(f"  {n} GPUs vs 1", losses(f"{model}_{n}gpu"), one, steps, limit)
        compare(f"  {n} GPUs ZeRO-1 vs 1", losses(f"{model}_{n}gpu_zero1"), one, steps, limit)
if "resume" in parts:
    compare(f"gpt2-124m: resumed {n}->1 GPU vs {n}-GPU run", losses(f"resume_{n}to1"), losses(f"gpt2-124m_{n}gpu"),
            range(11, 21), 0.01)
    compare(f"gpt2-124m: resumed 1->{n} GPUs vs 1-GPU run", losses(f"resume_1to{n}"), losses("gpt2-124m_1gpu"),
            range(11, 21), 0.01)

if "scaling" in parts:
    print(f"\n{'bench (coda mode)':<30} {'ms/step':>9} {'tok/s/GPU':>10} {'scaling':>8} {'mem GiB':>8} {'all-reduce ms':>14}")
    for model in models:
        base = None
        for run in (f"{model}_1gpu", f"{model}_{n}gpu", f"{model}_{n}gpu_zero1"):
            try:
                r = json.load(open(f"{logs}/bench_{run}.json"))[0]
            except (OSError, ValueError, IndexError):
                print(f"{run:<30} no result")
                failed = True
                continue
            base = base or r["tokens_per_s_per_gpu"]
            scaling = r["tokens_per_s_per_gpu"] / base
            print(f"{run:<30} {r['median_ms']:9.2f} {r['tokens_per_s_per_gpu']:10.0f} {100 * scaling:7.1f}% "
                  f"{r['memory_gib']:8.1f} {r['gradient_all_reduce_ms']:14.2f}")
    print("(scaling: tokens/s per GPU over the 1-GPU run; target >= 90%)")
sys.exit(1 if failed else 0)
PY
rm -rf "$work"
exit $status
