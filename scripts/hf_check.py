#!/usr/bin/env python3
"""Load a CODA checkpoint directory with Hugging Face transformers, exactly as a user would, and run a
fixed token sequence through it in fp32 on the CPU.

Prints the mean next-token cross-entropy over the sequence (position t predicts token t+1) and the
first logits of the first and last positions, so the numbers can be compared with `coda eval` or with
the trainer's CPU reference on the same tokens. With --ref FILE (a JSON object {"tokens": [...],
"logits": [[...], ...]} of unpadded [T, vocab] logits from the CPU reference) it also reports the
largest absolute logit difference and fails when it exceeds --tol.

Needs: pip install torch transformers safetensors
Usage: python scripts/hf_check.py CHECKPOINT_DIR [--tokens 1,2,3,...] [--ref ref.json] [--tol 1e-4]
"""
import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def default_tokens(vocab_size, length=16):
    return [(7 + 31 * i * i + 13 * i) % vocab_size for i in range(length)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", help="comma-separated token ids (default: a fixed pseudo-random sequence)")
    parser.add_argument("--ref", help="JSON file with reference tokens and logits to compare against")
    parser.add_argument("--tol", type=float, default=1e-4, help="max abs logit difference allowed with --ref")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    model.eval()
    config = model.config
    print(f"loaded {type(model).__name__}: vocab {config.vocab_size}, layers {config.num_hidden_layers}, "
          f"parameters {sum(p.numel() for p in model.parameters())}")

    reference = None
    if args.ref:
        with open(args.ref) as f:
            reference = json.load(f)
    if reference is not None:
        tokens = reference["tokens"]
    elif args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = default_tokens(config.vocab_size)
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()  # [T, vocab]
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
    print("tokens:", ",".join(str(t) for t in tokens))
    print(f"mean cross-entropy (next token, {len(tokens) - 1} predictions): {loss:.6f}")
    print("logits[0, :8]:", " ".join(f"{v:.6f}" for v in logits[0, :8].tolist()))
    print("logits[-1, :8]:", " ".join(f"{v:.6f}" for v in logits[-1, :8].tolist()))

    if reference is not None:
        ref = torch.tensor(reference["logits"], dtype=torch.float64)
        if ref.shape != logits.shape:
            sys.exit(f"reference logits have shape {tuple(ref.shape)}, HF gives {tuple(logits.shape)}")
        diff = (logits - ref).abs().max().item()
        scale = ref.abs().max().item()
        print(f"max |HF - reference| logit difference: {diff:.3e} (largest |logit| {scale:.3f})")
        if not diff <= args.tol:
            sys.exit(f"FAIL: difference {diff:.3e} exceeds tolerance {args.tol:.1e}")
        print("OK")


if __name__ == "__main__":
    main()
