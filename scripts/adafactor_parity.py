#!/usr/bin/env python3
"""Fixture for the Adafactor optimizer (run by hand; transformers 4.57.1):

    pip install torch "transformers==4.57.1"
    python scripts/adafactor_parity.py      # writes tests/fixtures/adafactor/

`transformers.optimization.Adafactor` on three fp32 parameters (a matrix and a 3-D tensor,
whose second moments are factored over the last two dimensions, and a vector, whose are not),
four steps with fixed gradients, in two configurations: what HF Trainer's `--optim adafactor`
builds (external learning rate: scale_parameter, relative_step and warmup_init off) with weight
decay, and the paper's defaults (relative step size, parameter scale, no learning rate) with a
first moment; and a loose clipping threshold with another decay rate. The weights after every
step and the final state are recorded.
"""
import json
import math
import os

import torch
from transformers.optimization import Adafactor

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "adafactor")
SHAPES = [[4, 6], [7], [2, 3, 5]]
STEPS = 4


def values(shape, seed, scale):
    n = math.prod(shape)
    i = torch.arange(n, dtype=torch.float64)
    return (torch.sin(i * 0.37 + seed) * scale + 0.05 * torch.cos(i * 1.3 * seed)).float().reshape(shape)


def run(kwargs):
    params = [torch.nn.Parameter(values(s, k + 1, 0.5)) for k, s in enumerate(SHAPES)]
    opt = Adafactor(params, **kwargs)
    grads, weights = [], []
    for step in range(STEPS):
        gs = [values(s, 10 * step + k + 3, 0.1 * (step + 1)) for k, s in enumerate(SHAPES)]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        grads.append([g.flatten().tolist() for g in gs])
        weights.append([p.detach().flatten().tolist() for p in params])
    state = []
    for p in params:
        st = opt.state[p]
        state.append({k: v.flatten().tolist() for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
    return {"grads": grads, "weights": weights, "state": state}


def main():
    os.makedirs(OUT, exist_ok=True)
    cases = {
        "trainer": dict(lr=1e-2, weight_decay=0.01, scale_parameter=False, relative_step=False,
                        warmup_init=False),
        "paper": dict(lr=None, beta1=0.9, scale_parameter=True, relative_step=True,
                      warmup_init=False),
        # Updates whose RMS stays under the threshold (the clamp at 1 decides), another decay.
        "loose_clip": dict(lr=1e-2, clip_threshold=4.0, decay_rate=-0.5, scale_parameter=False,
                           relative_step=False, warmup_init=False),
    }
    out = {
        "shapes": SHAPES,
        "init": [values(s, k + 1, 0.5).flatten().tolist() for k, s in enumerate(SHAPES)],
        "cases": {},
    }
    for name, kwargs in cases.items():
        out["cases"][name] = {"kwargs": kwargs, **run(kwargs)}
    with open(os.path.join(OUT, "adafactor.json"), "w") as f:
        json.dump(out, f)
    print("wrote", OUT, "torch", torch.__version__)


if __name__ == "__main__":
    main()
