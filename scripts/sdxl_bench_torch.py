#!/usr/bin/env python3
"""PyTorch + diffusers side of `sdxl-ft`'s bench: one train step (forward, MSE to a fixed target,
backward, AdamW) of a randomly initialised SDXL-shaped UNet2DConditionModel on CPU, f32, batch 1,
77 text tokens. The shape comes as a diffusers config JSON (the Rust side writes the same one).
Prints one JSON line (see bench_common.py for the memory measure).
"""
import argparse
import json
import os
import sys

import torch
from diffusers import UNet2DConditionModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import measure_and_print  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--latent", type=int, default=16)
    p.add_argument("--pooled", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpointing", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    with open(a.config) as f:
        cfg = json.load(f)
    unet = UNet2DConditionModel.from_config(cfg).float().train()
    if a.checkpointing:
        unet.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    x = torch.randn(1, cfg["in_channels"], a.latent, a.latent)
    t = torch.tensor([500])
    ctx = torch.randn(1, 77, cfg["cross_attention_dim"])
    added = {"text_embeds": torch.randn(1, a.pooled),
             "time_ids": torch.tensor([[a.latent * 8, a.latent * 8, 0, 0, a.latent * 8, a.latent * 8]],
                                      dtype=torch.float32)}
    target = torch.randn_like(x)

    def step():
        pred = unet(x, t, ctx, added_cond_kwargs=added).sample
        torch.nn.functional.mse_loss(pred, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measure_and_print(step, a.steps, params=sum(q.numel() for q in unet.parameters()))


if __name__ == "__main__":
    main()
