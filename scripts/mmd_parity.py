#!/usr/bin/env python3
"""Fixture for the MMD estimators of `ft_trainer::score` (run by hand; torch 2.15, torchmetrics
1.9.0):

    pip install torch "torchmetrics==1.9.0"
    python scripts/mmd_parity.py      # writes tests/fixtures/mmd/mmd.json

Two feature sets per case (deterministic values), and for each:
- `kid`: torchmetrics' KID kernel and estimator, `torchmetrics.image.kid.poly_mmd` (polynomial
  kernel (x.y / d + 1)^3, unbiased MMD^2) on equal-sized sets, as torchmetrics computes each
  subset's value; on sets of different sizes (which torchmetrics does not take) the same
  unbiased estimator written out;
- `cmmd`: the CMMD paper's reference code (google-research/google-research cmmd/distance.py:
  Gaussian RBF with sigma 10, the means of the whole kernel matrices, diagonals included, times
  1000), written here in float64;
- `rbf_unbiased`: the unbiased estimator with that Gaussian kernel (sigma 10), for comparison.
"""
import json
import math
import os

import numpy as np
import torch
from torchmetrics.image.kid import poly_mmd

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "mmd")


def features(n, d, seed, shift):
    i = np.arange(n * d, dtype=np.float64)
    v = np.sin(i * 0.37 + seed) * 3.0 + 0.5 * np.cos(i * 1.3 * seed) + shift
    return v.reshape(n, d)


def unbiased(kxx, kyy, kxy):
    n, m = kxx.shape[0], kyy.shape[0]
    xx = (kxx.sum() - np.trace(kxx)) / (n * (n - 1))
    yy = (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
    return xx + yy - 2 * kxy.mean()


def poly(a, b):
    return (a @ b.T / a.shape[1] + 1.0) ** 3


def rbf(a, b, sigma=10.0):
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return np.exp(-d2 / (2 * sigma**2))


def cmmd_reference(x, y, sigma=10.0, scale=1000.0):
    # cmmd/distance.py's formula, in float64.
    gamma = 1 / (2 * sigma**2)
    xs, ys = np.diag(x @ x.T), np.diag(y @ y.T)
    k_xx = np.mean(np.exp(-gamma * (-2 * x @ x.T + xs[:, None] + xs[None, :])))
    k_xy = np.mean(np.exp(-gamma * (-2 * x @ y.T + xs[:, None] + ys[None, :])))
    k_yy = np.mean(np.exp(-gamma * (-2 * y @ y.T + ys[:, None] + ys[None, :])))
    return scale * (k_xx + k_yy - 2 * k_xy)


cases = []
for name, n, m, d, shift in [("same size", 12, 12, 16, 0.3), ("sizes differ", 10, 7, 16, 1.0), ("same distribution", 9, 9, 8, 0.0)]:
    x = features(n, d, 1.0, 0.0)
    y = features(m, d, 2.0 if shift else 1.5, shift)
    if n == m:
        kid = poly_mmd(torch.from_numpy(x), torch.from_numpy(y), degree=3, gamma=None, coef=1.0).item()
        assert math.isclose(kid, unbiased(poly(x, x), poly(y, y), poly(x, y)), rel_tol=1e-9)
    else:
        kid = unbiased(poly(x, x), poly(y, y), poly(x, y))
    cases.append({
        "name": name,
        "x": x.tolist(),
        "y": y.tolist(),
        "kid": kid,
        "cmmd": cmmd_reference(x, y),
        "rbf_unbiased": unbiased(rbf(x, x), rbf(y, y), rbf(x, y)),
    })

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "mmd.json"), "w") as f:
    json.dump({"torchmetrics": "1.9.0", "cases": cases}, f)
print("wrote", os.path.join(OUT, "mmd.json"), [(c["name"], c["kid"], c["cmmd"]) for c in cases])
