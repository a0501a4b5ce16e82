#!/usr/bin/env python3
"""Parity fixture for the SDXL UNet (run by hand; torch + diffusers 0.35.2):

    python scripts/unet_parity.py      # writes tests/fixtures/unet_tiny/

A tiny SDXL-shaped UNet2DConditionModel (text_time added embeddings, linear projections,
per-level transformer depth, per-sample timesteps): weights, config, fixed inputs, the output,
and every parameter's gradient of sum(w * output).
"""
import os

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "unet_tiny")


def main():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=[16, 32], down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4],
        transformer_layers_per_block=[1, 2], cross_attention_dim=24, norm_num_groups=8,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 12).float()
    unet.save_pretrained(OUT, safe_serialization=True)
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10.0, 700.0])
    ctx = torch.randn(2, 5, 24)
    text_embeds = torch.randn(2, 12)
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0], [96.0, 80.0, 8.0, 4.0, 64.0, 64.0]])
    out = unet(x, t, encoder_hidden_states=ctx,
               added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * w).sum().backward()
    save_file({"x": x, "timesteps": t, "context": ctx, "text_embeds": text_embeds, "time_ids": time_ids,
               "out": out.detach().contiguous(), "w": w}, os.path.join(OUT, "inputs.safetensors"))
    save_file({k: p.grad.contiguous() for k, p in unet.named_parameters() if p.grad is not None},
              os.path.join(OUT, "grads.safetensors"))
    print("written", OUT, sum(p.numel() for p in unet.parameters()), "parameters")


if __name__ == "__main__":
    main()
