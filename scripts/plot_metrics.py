#!/usr/bin/env python3
"""Loss and throughput curves of one or more coda run directories, drawn to one PNG.

Reads RUN/metrics.jsonl (one JSON object per step: step, loss, tokens_per_s, and val_loss on the steps
that were evaluated) and draws two panels: training loss (with validation loss as markers) and
tokens/s, one colour per run.

    python3 scripts/plot_metrics.py runs/tiny-gpt2-* -o loss.png
"""
import argparse
import json
import os
import sys


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path}: no such file (is {run_dir} a coda run directory?)")
    records = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"error: {path}:{number}: {e}")
    if not records:
        sys.exit(f"error: {path}: no steps recorded yet")
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default="metrics.png", help="PNG to write (default: metrics.png)")
    args = parser.parse_args()

    runs = [(run, read_metrics(run)) for run in args.runs]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: matplotlib is not installed: `apt-get install python3-matplotlib` or `pip install matplotlib`")

    figure, (loss_axes, speed_axes) = plt.subplots(1, 2, figsize=(13, 4.5))
    for run, records in runs:
        label = os.path.basename(os.path.normpath(run))
        steps = [r["step"] for r in records]
        line, = loss_axes.plot(steps, [r["loss"] for r in records], label=f"{label} train", linewidth=1)
        evaluated = [r for r in records if "val_loss" in r]
        if evaluated:
            loss_axes.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o--",
                           color=line.get_color(), label=f"{label} val", markersize=4)
        timed = [r for r in records if "tokens_per_s" in r]
        speed_axes.plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], label=label, linewidth=1)
    loss_axes.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    speed_axes.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for axes in (loss_axes, speed_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
