#!/usr/bin/env bash
# FP8 against bf16 on real text: each model trained twice with one seed, once per precision, in the unfused
# mode (so precision is the only difference), then the final validation losses side by side and both
# curves in one plot.
#   scripts/fp8_validation.sh TRAIN_GLOB VAL_GLOB [STEPS]
#     TRAIN_GLOB, VAL_GLOB   token shards (coda prepare text, or data/prepare_gpt2.py's fineweb shards); on a
#                            machine without a corpus or network, the installed Python sources are real text
#                            that any such machine has: coda prepare text $(find "$(python3 -c 'import torch,
#                            os; print(os.path.dirname(torch.__file__))')" -name '*.py' | sort) --out DIR
#     STEPS                  optimizer steps per run (default 1000); warmup and validation every STEPS/10
#   MODELS="gpt2-124m llama3.2-1b"   configs/NAME.toml to train (their batch, sequence and learning rate)
#   CODA=build/coda RUNS=runs/fp8-validation    the binary, and where the runs and the plot go
#   TRAIN_FLAGS="--batch_size 4"     more flags for every run (both precisions alike)
#   FP8_LINEARS=qkv,attn_proj        the block linears of the fp8 runs (default all four); the runs go to
#                                    NAME-fp8-qkv,attn_proj and are compared with the same bf16 runs
#   FP8_SCALING=block                the fp8 runs' fp8_scaling (default tensor; block, or the linears with
#                                    block scales, e.g. mlp_down); the runs go to NAME-fp8-block, NAME-fp8-mlp_down
#   SEED=1338                        the seed of both runs (default 1337; others go to NAME-...-seed1338): a
#                                    second seed's bf16 run is the spread an fp8 gap must exceed to be one
# Needs a GPU for the big configs (a 1000-step run on one H100: about 1.2 min for gpt2-124m, 2.2 min for
# llama3.2-1b at --batch_size 4). The summary passes when fp8's final validation loss is within 1% of bf16's.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -lt 2 ]]; then
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
train=$1 val=$2 steps=${3:-1000}
coda=${CODA:-build/coda}
out=${RUNS:-runs/fp8-validation}
models=${MODELS:-gpt2-124m llama3.2-1b}
read -r -a extra <<<"${TRAIN_FLAGS:-}"
linears=${FP8_LINEARS:-}
scaling=${FP8_SCALING:-tensor}
seed=${SEED:-1337}
seed_suffix=$([[ $seed == 1337 ]] || echo "-seed$seed")
fp8_run=fp8$([[ $scaling == tensor ]] || echo "-$scaling")${linears:+-$linears}$seed_suffix
bf16_run=bf16$seed_suffix
every=$(( steps / 10 > 0 ? steps / 10 : 1 ))

for model in $models; do
  for precision in bf16 fp8; do
    run="$out/$model-$([[ $precision == fp8 ]] && echo "$fp8_run" || echo "$bf16_run")"
    subset=()
    [[ $precision == fp8 && -n $linears ]] && subset=(--fp8_linears "$linears")
    [[ $precision == fp8 ]] && subset+=(--fp8_scaling "$scaling")
    if [[ -f "$run/step_$steps/trainer_state.json" ]]; then
      echo "== $run: done already"
      continue
    fi
    echo "== $model, $precision, $steps steps -> $run"
    "$coda" train --config "configs/$model.toml" --precision "$precision" --kernels unfused \
      --train_data "$train" --val_data "$val" --steps "$steps" --warmup_steps "$every" --val_every "$every" \
      --checkpoint_every 0 --keep_checkpoints 1 --seed "$seed" --out "$run" "${subset[@]}" "${extra[@]}"
  done
done

plots=()
for model in $models; do plots+=("$out/$model-$bf16_run" "$out/$model-$fp8_run"); done
plot="$out/${fp8_run/fp8/fp8_validation}.png"
python3 scripts/plot_metrics.py "${plots[@]}" -o "$plot"
python3 - "$out" "$bf16_run" "$fp8_run" "$plot" $models <<'PY'
import json, sys
out, bf16_run, fp8_run, plot, models = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
def final_val(run):
    losses = [r["val_loss"] for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "val_loss" in r]
    return losses[-1]
failed = False
print(f"{'model':<14} {'bf16 val':>9} {'fp8 val':>9} {'fp8 / bf16':>11}")
for model in models:
    bf16, fp8 = final_val(f"{out}/{model}-{bf16_run}"), final_val(f"{out}/{model}-{fp8_run}")
    ratio = fp8 / bf16
    failed |= abs(ratio - 1) > 0.01
    print(f"{model:<14} {bf16:9.4f} {fp8:9.4f} {ratio:11.4f}")
print(f"runs: {out}/MODEL-{bf16_run} and {out}/MODEL-{fp8_run}; plot: {plot}")
sys.exit(1 if failed else 0)
PY
