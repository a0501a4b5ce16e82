#!/usr/bin/env python3
"""Loads an sdxl-ft checkpoint's `unet/` (and `unet_ema/` when present) with diffusers and checks
that every tensor is used and none is missing (run by hand; torch + diffusers 0.35.2):

    sdxl-ft --demo --output-dir runs/sdxl-demo
    python scripts/sdxl_checkpoint_in_diffusers.py runs/sdxl-demo/checkpoint-120
"""
import os
import sys

import torch
from diffusers import UNet2DConditionModel


def main():
    ckpt = sys.argv[1]
    for sub in ["unet", "unet_ema"]:
        path = os.path.join(ckpt, sub)
        if not os.path.isdir(path):
            continue
        model, info = UNet2DConditionModel.from_pretrained(path, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"{path}: {bad}"
        cfg = model.config
        x = torch.randn(1, cfg.in_channels, 8, 8)
        ctx = torch.randn(1, 77, cfg.cross_attention_dim)
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        added = {"text_embeds": torch.randn(1, pooled), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}
        with torch.no_grad():
            out = model(x, torch.tensor([500]), ctx, added_cond_kwargs=added).sample
        assert torch.isfinite(out).all()
        n = sum(p.numel() for p in model.parameters())
        print(f"{path}: loads in diffusers, {n} parameters, none missing or unexpected, finite output")


if __name__ == "__main__":
    main()
