#!/usr/bin/env python3
"""A `coda train` run's step time against `coda bench`'s for the same shape: the median of the run's step
times after the first five (metrics.jsonl "ms") over the bench's median for one backend (its --json file).

Usage: python3 scripts/train_vs_bench.py RUN_DIR/metrics.jsonl BENCH.json [BACKEND]   (default cuda-coda)
"""
import json
import statistics
import sys


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    backend = sys.argv[3] if len(sys.argv) == 4 else "cuda-coda"
    with open(sys.argv[1]) as f:
        ms = [r["ms"] for r in map(json.loads, f) if "ms" in r]
    with open(sys.argv[2]) as f:
        bench = {r["backend"]: r["median_ms"] for r in json.load(f)}[backend]
    train = statistics.median(ms[5:])
    print(f"train {train:.2f} ms/step (median of steps 6-{len(ms)}), bench {bench:.2f}: train / bench "
          f"{train / bench:.3f}")


if __name__ == "__main__":
    main()
