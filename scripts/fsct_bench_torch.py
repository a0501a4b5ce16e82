#!/usr/bin/env python3
"""PyTorch side of `fewshot-ft`'s bench (`cargo run --release -p fewshot-ft --example fsct_bench`):
one training episode (forward, backward, AdamW) of FSCT_cosine on a Conv4 or ResNet10 backbone
(the CloserLook backbones fewshot-ft builds), `--n-way`-way `--k-shot`-shot with `--n-query`
queries a class, random `--size` px images, f32 on CPU. Prints one JSON line.

The FSCT (cosine attention, cosine linear head) and Conv4 are scripts/fsct_parity.py's (the
model the parity fixtures come from); ResNet10 is written here from the CloserLook code (7x7 stride-2 stem,
batch norm, ReLU, 3x3 stride-2 max pool; one SimpleBlock a stage at 64, 128, 256 and 512
channels; average pool).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import measure  # noqa: E402
from fsct_parity import FSCT, Conv4  # noqa: E402


class SimpleBlock(nn.Module):
    def __init__(self, cin, cout, half):
        super().__init__()
        self.C1 = nn.Conv2d(cin, cout, 3, stride=2 if half else 1, padding=1, bias=False)
        self.BN1 = nn.BatchNorm2d(cout)
        self.C2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.BN2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=2 if half else 1, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.BN1(self.C1(x)))
        h = self.BN2(self.C2(h))
        s = x if self.shortcut is None else self.shortcut(x)
        return F.relu(h + s)


class ResNet10(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
        cin = 64
        for i, cout in enumerate([64, 128, 256, 512]):
            layers.append(SimpleBlock(cin, cout, i > 0))
            cin = cout
        self.trunk = nn.Sequential(*layers)

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.trunk(x), 1).flatten(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backbone", choices=["conv4", "resnet10"], default="conv4")
    p.add_argument("--size", type=int, default=84)
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--k-shot", type=int, default=1)
    p.add_argument("--n-query", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.backbone == "conv4":
        # Conv4 flattens its last map: 64 x (size / 16)^2 features.
        backbone, dim = Conv4(), 64 * (a.size // 16) ** 2
    else:
        backbone, dim = ResNet10(), 512
    model = FSCT(True, dim=dim, backbone=backbone, n_way=a.n_way, k_shot=a.k_shot,
                 n_query=a.n_query).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = a.n_way * (a.k_shot + a.n_query)
    images = torch.randn(n, 3, a.size, a.size)
    targets = torch.arange(a.n_way).repeat_interleave(a.n_query)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), targets)
        loss.backward()
        opt.step()

    # Measured first (its peak above the start is clean only before any other step), then one
    # more episode timed by phase (forward, backward, optimizer step), as the Rust side does.
    measured = measure(step, a.steps)
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(images), targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    print(json.dumps({**measured, "backbone": a.backbone,
                      "params": sum(q.numel() for q in model.parameters()),
                      "phases_s": [t1 - t0, t2 - t1, t3 - t2]}))


if __name__ == "__main__":
    main()
