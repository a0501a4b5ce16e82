#!/usr/bin/env python3
"""Fixture for the evaluation samplers (run by hand; torch + diffusers 0.35.2):

    python scripts/sampler_parity.py      # writes tests/fixtures/sampling/sampling.json

SDXL's scheduler config (scaled_linear 0.00085..0.012, leading spacing, steps_offset 1) with
EulerDiscreteScheduler and DDIMScheduler (eta 0), both prediction types, 10 steps, driven by a
fixed stand-in model `out = 0.3 * x_in + 0.05 * t / 1000` from fixed initial noise. Records the
timesteps, the initial noise scale and the final latents.
"""
import json
import os

import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "sampling")


def run(cls, pred, steps, noise):
    cfg = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
               prediction_type=pred, steps_offset=1, timestep_spacing="leading")
    if cls is DDIMScheduler:
        cfg.update(set_alpha_to_one=False, clip_sample=False)
    s = cls(**cfg)
    s.set_timesteps(steps)
    x = noise.double() * s.init_noise_sigma
    for t in s.timesteps:
        x_in = s.scale_model_input(x, t)
        out = 0.3 * x_in + 0.05 * float(t) / 1000.0
        x = s.step(out, t, x).prev_sample
    return {"timesteps": [int(t) for t in s.timesteps], "init_noise_sigma": float(s.init_noise_sigma),
            "final": x.flatten().tolist()}


def main():
    os.makedirs(OUT, exist_ok=True)
    noise = torch.linspace(-1.5, 1.5, 2 * 4 * 2 * 2).reshape(2, 4, 2, 2)
    out = {"noise": noise.flatten().tolist(), "steps": 10}
    for name, cls in [("euler", EulerDiscreteScheduler), ("ddim", DDIMScheduler)]:
        for pred in ["epsilon", "v_prediction"]:
            out[f"{name}/{pred}"] = run(cls, pred, 10, noise)
    with open(os.path.join(OUT, "sampling.json"), "w") as f:
        json.dump(out, f)
    print("written", OUT)


if __name__ == "__main__":
    main()
