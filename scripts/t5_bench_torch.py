#!/usr/bin/env python3
"""PyTorch + transformers side of `t5-ft`'s bench: one train step (forward, backward, AdamW) of a
randomly initialised T5 of the given shape on CPU. Prints one JSON line.

Peak memory is the resident-set high-water mark above the level after a warm-up step and above
the level before it (`bench_common.measure`), the measures the Rust side reports.
"""
import argparse
import os
import sys

import torch
from transformers import T5Config, T5ForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import measure_and_print  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--src", type=int, default=64)
    p.add_argument("--tgt", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpointing", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    # 1: torch.set_flush_denormal(True), subnormal floats read and written as zero (x86's FTZ and
    # DAZ). The head's tiny probabilities are subnormal, and slow to multiply without it.
    p.add_argument("--flush-denormal", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.flush_denormal and not torch.set_flush_denormal(True):
        sys.exit("this CPU cannot flush denormals")
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=a.vocab, d_model=a.d_model, d_kv=a.d_model // a.heads, d_ff=a.d_ff,
                   num_layers=a.layers, num_heads=a.heads, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False, dropout_rate=0.0,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).float().train()
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(2, a.vocab, (a.batch, a.src))
    labels = torch.randint(2, a.vocab, (a.batch, a.tgt))

    def step():
        out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measure_and_print(step, a.steps)


if __name__ == "__main__":
    main()
