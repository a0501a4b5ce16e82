#!/usr/bin/env python3
"""Parity fixture for the VAE (run by hand; torch + diffusers 0.35.2):

    python scripts/vae_parity.py      # writes tests/fixtures/vae_tiny/

A tiny AutoencoderKL (two levels, 16 and 32 channels, norm groups 8, SDXL's scaling factor):
weights, config, fixed images, the encoder's posterior mean and log-variance, and the decoder's
output for fixed latents, whole and in tiles (`enable_tiling` with 4-latent-pixel tiles).
"""
import os

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "vae_tiny")


def main():
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32],
                        layers_per_block=1, latent_channels=4, norm_num_groups=8,
                        scaling_factor=0.13025).float().eval()
    vae.save_pretrained(OUT, safe_serialization=True)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    latents = torch.randn(3, 4, 8, 8)
    tiled_latents = torch.randn(1, 4, 10, 10)
    with torch.no_grad():
        post = vae.encode(images).latent_dist
        decoded = vae.decode(latents / vae.config.scaling_factor).sample
        # Tiled decoding with 4-latent-pixel (8-pixel) tiles: stride 3, blend 2, edge tiles of 1.
        vae.enable_tiling()
        vae.tile_sample_min_size = 8
        vae.tile_latent_min_size = 4
        tiled = vae.decode(tiled_latents / vae.config.scaling_factor).sample
    save_file({"images": images, "mean": post.mean.contiguous(), "logvar": post.logvar.contiguous(),
               "latents": latents, "decoded": decoded.contiguous(), "tiled_latents": tiled_latents,
               "tiled": tiled.contiguous()}, os.path.join(OUT, "outputs.safetensors"))
    print("written", OUT)


if __name__ == "__main__":
    main()
