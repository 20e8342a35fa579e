#!/usr/bin/env python3
"""GPT-2-tokenize text files into token shards that `coda train` reads.

Each input file is one document: its GPT-2 tokens (tiktoken's "gpt2" encoding, vocabulary 50257) are
preceded by the end-of-text token 50256, as GPT-2 and llm.c do, so the model learns document starts.
The last --val_fraction of each file's tokens goes to validation. Shards use the llm.c format with
uint16 tokens: a 1024-byte header of 256 int32 (magic 20240520, version 1, token count), then the
tokens. Each shard is written to NAME.tmp and renamed, so a shard that exists is complete; dataset.json
is written last.

tiktoken downloads the GPT-2 BPE files (vocab.bpe, encoder.json) from the internet on first use and caches
them (set TIKTOKEN_CACHE_DIR to choose where), so run this once on a machine with network access.
This is data preparation; training never runs Python.

    pip install tiktoken numpy
    python data/prepare_gpt2.py book1.txt book2.txt --out data/books --val_fraction 0.05
"""
import argparse
import glob
import json
import os
import sys

import numpy as np
import tiktoken

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256


def write_shard(path, tokens):
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, VERSION, len(tokens)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
    os.replace(tmp, path)


class ShardWriter:
    """Collects one split's tokens and writes DIR/SPLIT_000000.bin, ... every shard_tokens tokens."""

    def __init__(self, out_dir, split, shard_tokens):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.buffer = np.empty(0, dtype=np.uint16)
        self.tokens = self.shards = 0

    def add(self, tokens):
        self.buffer = np.concatenate([self.buffer, tokens])
        while len(self.buffer) >= self.shard_tokens:
            self._flush(self.buffer[: self.shard_tokens])
            self.buffer = self.buffer[self.shard_tokens :]

    def finish(self):
        if len(self.buffer):
            self._flush(self.buffer)
            self.buffer = self.buffer[:0]

    def _flush(self, tokens):
        write_shard(os.path.join(self.out_dir, f"{self.split}_{self.shards:06d}.bin"), tokens)
        self.tokens += len(tokens)
        self.shards += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="input text files (UTF-8), one document each")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="fraction of each file (its end) for validation")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    args = parser.parse_args()

    if not 0.0 <= args.val_fraction < 1.0:
        sys.exit(f"prepare_gpt2: --val_fraction {args.val_fraction} must be in [0, 1)")
    if not 1 <= args.shard_tokens < 2**31:
        sys.exit(f"prepare_gpt2: --shard_tokens {args.shard_tokens} must be in [1, 2^31)")
    for path in args.files:
        if not os.path.isfile(path):
            sys.exit(f"prepare_gpt2: input file {path} does not exist or is not a regular file")

    encoding = tiktoken.get_encoding("gpt2")
    eot = encoding.eot_token
    os.makedirs(args.out, exist_ok=True)
    stale = glob.glob(os.path.join(args.out, "train_[0-9]*.bin")) + glob.glob(os.path.join(args.out, "val_[0-9]*.bin"))
    for path in stale:
        os.remove(path)
    if stale:
        print(f"prepare_gpt2: removed {len(stale)} shards of an earlier preparation in {args.out}")

    train = ShardWriter(args.out, "train", args.shard_tokens)
    val = ShardWriter(args.out, "val", args.shard_tokens)
    for index, path in enumerate(args.files):
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
        tokens = np.array([eot] + encoding.encode_ordinary(text), dtype=np.uint16)
        n_val = int(round(args.val_fraction * len(tokens)))
        train.add(tokens[: len(tokens) - n_val])
        val.add(tokens[len(tokens) - n_val :])
        print(f"prepare_gpt2: {index + 1}/{len(args.files)} files ({100 * (index + 1) // len(args.files)}%), "
              f"{path}: {len(tokens)} tokens")
    train.finish()
    val.finish()
    if train.tokens <= 1:
        sys.exit("prepare_gpt2: no training tokens were written (empty input?)")
    if args.val_fraction > 0 and val.tokens == 0:
        sys.exit(f"prepare_gpt2: --val_fraction {args.val_fraction} leaves no validation tokens")

    info = {
        "tokenizer": "gpt2",
        "vocab_size": encoding.n_vocab,
        "eot_token": eot,
        "train_tokens": train.tokens,
        "train_shards": train.shards,
        "val_tokens": val.tokens,
        "val_shards": val.shards,
        "shard_tokens": args.shard_tokens,
        "shard_format": f"llm.c uint16 (magic {MAGIC}, version {VERSION})",
        "source": "text",
        "files": args.files,
        "val_fraction": args.val_fraction,
    }
    with open(os.path.join(args.out, "dataset.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"prepare_gpt2: {train.tokens} train tokens in {train.shards} shards, "
          f"{val.tokens} val tokens in {val.shards} shards in {args.out}")


if __name__ == "__main__":
    main()
