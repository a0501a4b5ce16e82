#!/usr/bin/env python3
"""Fixture for the diffusion objective (run by hand; diffusers 0.35.2, which works beside transformers 4.57.1):

    pip install torch "diffusers==0.35.2"
    python scripts/ddpm_parity.py      # writes tests/fixtures/ddpm/

SDXL's scheduler config (scaled_linear 0.00085..0.012, 1000 steps) in both prediction types:
alphas_cumprod at a few timesteps, add_noise and get_velocity on fixed tensors, and the
min-SNR-gamma weights as diffusers' train_text_to_image_sdxl.py computes them.
"""
import json
import os

import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "ddpm")


def main():
    os.makedirs(OUT, exist_ok=True)
    t = torch.tensor([0, 1, 250, 500, 999])
    x0 = torch.linspace(-1, 1, 5 * 2 * 2 * 2).reshape(5, 2, 2, 2)
    noise = torch.linspace(1, -0.5, 5 * 2 * 2 * 2).reshape(5, 2, 2, 2)
    out = {"timesteps": t.tolist(), "x0": x0.flatten().tolist(), "noise": noise.flatten().tolist()}
    for pred in ["epsilon", "v_prediction"]:
        cfg = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                   beta_schedule="scaled_linear", prediction_type=pred)
        s = DDPMScheduler(**cfg)
        snr = compute_snr(s, t)
        w = torch.stack([snr, 5.0 * torch.ones_like(t, dtype=snr.dtype)], dim=1).min(dim=1)[0]
        w = w / snr if pred == "epsilon" else w / (snr + 1)
        out[pred] = {
            "config": cfg,
            "alphas_cumprod": s.alphas_cumprod[t].tolist(),
            "noisy": s.add_noise(x0, noise, t).flatten().tolist(),
            "velocity": s.get_velocity(x0, noise, t).flatten().tolist(),
            "min_snr_5": w.tolist(),
        }
    with open(os.path.join(OUT, "ddpm.json"), "w") as f:
        json.dump(out, f)
    print("written", os.path.join(OUT, "ddpm.json"))


if __name__ == "__main__":
    main()
