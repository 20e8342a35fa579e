#!/usr/bin/env bash
# What a user sees of training runs on a GPU machine, end to end: Ctrl-C under mpirun (the step in progress
# finishes, a checkpoint is written, the exit code says which signal, and --resume continues from it),
# fine-tuning from a GPT-2 directory that transformers wrote (--init_from, in both GPU modes, with
# sample_every; the GPU's first loss against the CPU reference's), and llama3.2-1b's start-up (from its
# first log line to its first step) with its `coda train` step against `coda bench`. A summary table last.
#   scripts/run_checks.sh [BIN_DIR]     the binaries (default: build/)
# Needs a GPU, mpirun, and python3 with torch and transformers (to write the Hugging Face directory).
# Logs go to BIN_DIR/run-logs. Exits non-zero if a check failed.
set -uo pipefail
set -m  # background jobs get their own process group and keep SIGINT's default, as from a terminal
cd "$(dirname "$0")/.."

bin=${1:-build}
logs=$bin/run-logs
rm -rf "$logs" && mkdir -p "$logs"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0 OMP_WAIT_POLICY=PASSIVE
work=$(mktemp -d)
status=0
declare -a summary
report() {  # name, ok (0/1), detail
  summary+=("$(printf '%-34s %-5s %s' "$1" "$([[ $2 == 0 ]] && echo ok || echo FAIL)" "$3")")
  [[ $2 == 0 ]] || status=1
}
"$bin/coda" prepare synthetic --out "$work/synthetic" >"$logs/prepare.log" 2>&1 || status=1
data=(--train_data "$work/synthetic/train_*.bin" --val_data "$work/synthetic/val_*.bin")
steps_logged() { cat "$1/metrics.jsonl" 2>/dev/null | grep -c '"loss"'; }

# 1. Ctrl-C: SIGINT to mpirun once 20 steps are logged (mpirun passes it on as SIGTERM 10 s later, the
#    --mca value, and the rank's own stderr is kept: mpirun stops forwarding output once it is signalled);
#    then resume for 10 more steps.
run=$work/sigint
mpirun --mca odls_base_sigkill_timeout 10 -np 1 bash -c "exec $bin/coda train --config configs/tiny-gpt2.toml \
  --device cuda --steps 1000000 --log_every 1 --val_every 0 --train_data '$work/synthetic/train_*.bin' \
  --val_data '$work/synthetic/val_*.bin' --out $run 2> $logs/sigint.log" \
  >"$logs/sigint_mpirun.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  (( $(steps_logged "$run") >= 20 )) && break
  sleep 0.1
done
kill -INT $launcher
wait $launcher
rc=$?
checkpoint=$(ls -d "$run"/step_* 2>/dev/null | grep -v '\.tmp$' | sort -V | tail -n 1)
said=$(grep -o 'stopped by SIG[A-Z]* after step [0-9]*' "$logs/sigint.log" | head -n 1)
report "Ctrl-C under mpirun -np 1" $([[ -n $checkpoint && -n $said ]] && echo 0 || echo 1) \
  "mpirun rc $rc, rank: '${said:-no message}', checkpoint ${checkpoint##*/}"
if [[ -n $checkpoint ]]; then
  done_steps=${checkpoint##*step_}
  mpirun -np 1 "$bin/coda" train --config configs/tiny-gpt2.toml --device cuda --steps $((done_steps + 10)) \
    --log_every 1 --val_every 0 "${data[@]}" --out "$run" --resume "$run" >"$logs/sigint_resume.log" 2>&1
  rc=$?
  report "resume after Ctrl-C" $([[ $rc == 0 && -d $run/step_$((done_steps + 10)) ]] && echo 0 || echo 1) \
    "rc $rc, step_$done_steps -> step_$((done_steps + 10)), $(steps_logged "$run") steps in metrics.jsonl"
fi

# 2. Fine-tuning from a transformers GPT-2 (byte vocabulary, 2 layers, d 128, head_dim 64).
hf=$work/hf-gpt2
python3 - "$hf" >"$logs/hf_write.log" 2>&1 <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
config = GPT2Config(vocab_size=256, n_positions=256, n_embd=128, n_layer=2, n_head=2)
GPT2LMHeadModel(config).save_pretrained(sys.argv[1], safe_serialization=True)
PY
[[ -f $hf/model.safetensors ]] || report "transformers writes GPT-2" 1 "see $logs/hf_write.log"
first_loss() { python3 -c "import json,sys; print([json.loads(l)['loss'] for l in open(sys.argv[1]) if '\"loss\"' in l][0])" "$1"; }
declare -A loss
for device in cpu cuda:unfused cuda:coda; do
  kernels=${device#*:}
  [[ $device == cpu ]] && kernels=auto
  "$bin/coda" train --config configs/tiny-gpt2.toml --init_from "$hf" --device "${device%%:*}" --kernels "$kernels" \
    --seq_len 128 --steps 30 --sample_every 10 --log_every 1 --val_every 0 "${data[@]}" \
    --out "$work/init_${device/:/_}" >"$logs/init_${device/:/_}.log" 2>&1
  rc=$?
  loss[$device]=$(first_loss "$work/init_${device/:/_}/metrics.jsonl" 2>/dev/null || echo nan)
  samples=$(grep -c 'sample: ' "$logs/init_${device/:/_}.log")
  report "--init_from HF GPT-2 ($device)" $([[ $rc == 0 && $samples -ge 3 ]] && echo 0 || echo 1) \
    "rc $rc, step-1 loss ${loss[$device]}, $samples sample lines"
done
close=$(python3 -c "import sys; a, b, c = map(float, sys.argv[1:]); print(int(max(abs(b - a), abs(c - a)) < 0.01 * a))" \
  "${loss[cpu]}" "${loss[cuda:unfused]}" "${loss[cuda:coda]}" 2>/dev/null || echo 0)
report "HF GPT-2: GPU step-1 loss = CPU's" $([[ $close == 1 ]] && echo 0 || echo 1) \
  "cpu ${loss[cpu]}, unfused ${loss[cuda:unfused]}, coda ${loss[cuda:coda]} (1%)"

# 3. llama3.2-1b: start-up time and the training step against the bench step.
"$bin/coda" train --config configs/llama3.2-1b.toml --device cuda --steps 25 --log_every 1 --val_every 0 \
  "${data[@]}" --out "$work/llama" >"$logs/llama_train.log" 2>&1
rc=$?
"$bin/coda" bench --config configs/llama3.2-1b.toml --kernels coda --warmup 3 --steps 20 --energy_seconds 0 \
  --json "$logs/llama_bench.json" >"$logs/llama_bench.log" 2>&1 || status=1
against_bench=$(python3 scripts/train_vs_bench.py "$work/llama/metrics.jsonl" "$logs/llama_bench.json" 2>&1 | tail -n 1)
first_step_at=$(python3 - "$logs/llama_train.log" <<'PY' 2>/dev/null
import re, sys
from datetime import datetime
stamped = [(m.group(1), line) for line in open(sys.argv[1]) for m in [re.match(r"\[(\d\d:\d\d:\d\d)\]", line)] if m]
first = next(stamp for stamp, line in stamped if re.search(r"\bstep\s+1/", line))
seconds = datetime.strptime(first, "%H:%M:%S") - datetime.strptime(stamped[0][0], "%H:%M:%S")
print(int(seconds.total_seconds()))
PY
)
report "llama3.2-1b coda train" $([[ $rc == 0 ]] && echo 0 || echo 1) \
  "rc $rc, first log line to step 1: ${first_step_at:-?} s; $against_bench"

echo
echo "== run checks ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${summary[@]}"
rm -rf "$work"
exit $status
