#!/usr/bin/env python3
"""Parity fixtures for fewshot-ft (run by hand, results committed):

    pip install torch safetensors
    python scripts/fsct_parity.py      # writes tests/fixtures/fsct_tiny/

A PyTorch FSCT written from the paper and the reference repository's description
(vinuni-vishc/Few-Shot-Cosine-Transformer: Conv4 "CloserLook" backbone, FewShotTransformer with
cosine or softmax attention, CosineDistLinear head), with the same parameter names as
fewshot-ft. For a tiny 3-way 1-shot episode of 16 px images it records, for each variant, the
weights, the episode, the query scores, the summed cross-entropy and every parameter gradient
(batch norm in training mode).
"""
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "fsct_tiny")
N_WAY, K_SHOT, N_QUERY, SIZE = 3, 1, 2, 16


class ConvBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.C = nn.Conv2d(cin, cout, 3, padding=1)
        self.BN = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.BN(self.C(x))), 2)


class Conv4(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(*[ConvBlock(3 if i == 0 else 64, 64) for i in range(4)])

    def forward(self, x):
        return self.trunk(x).flatten(1)


class Attention(nn.Module):
    def __init__(self, dim, heads, dim_head, cosine):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head, self.cosine = heads, dim_head, cosine
        self.input_linear = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, inner, bias=False))
        self.output_linear = nn.Linear(inner, dim)

    def split(self, t):  # 'q n (h d) -> h q n d'
        q, n, _ = t.shape
        return self.input_linear(t).reshape(q, n, self.heads, self.dim_head).permute(2, 0, 1, 3)

    def forward(self, q, k, v):
        fq, fk, fv = self.split(q), self.split(k), self.split(v)
        kt = fk.transpose(-1, -2)
        dots = fq @ kt
        if self.cosine:
            w = dots / (fq.norm(dim=-1, keepdim=True) * kt.norm(dim=-2, keepdim=True))
        else:
            w = torch.softmax(dots * self.dim_head ** -0.5, dim=-1)
        out = w @ fv
        h, qn, n, d = out.shape
        return self.output_linear(out.permute(1, 2, 0, 3).reshape(qn, n, h * d))


class CosineDistLinear(nn.Module):
    def __init__(self, indim, outdim):
        super().__init__()
        self.L = nn.Linear(indim, outdim, bias=False)
        # Weight normalisation over dim 0 with the names torch.nn.utils.weight_norm gives
        # (weight_g, weight_v), written out so the math is visible.
        v = self.L.weight.detach().clone()
        del self.L.weight
        self.L.weight_v = nn.Parameter(v)
        self.L.weight_g = nn.Parameter(torch.ones(outdim, 1))

    def forward(self, x):
        w = self.L.weight_g * self.L.weight_v / self.L.weight_v.norm(dim=1, keepdim=True)
        xn = x / (x.norm(p=2, dim=1).unsqueeze(1).expand_as(x) + 1e-5)
        return 2 * F.linear(xn, w)


class FSCT(nn.Module):
    # The episode's shape and the backbone default to the fixtures' (scripts/fsct_bench_torch.py
    # passes its own); `dim` is the backbone's feature size.
    def __init__(self, cosine, dim=64, heads=8, dim_head=64, mlp=512, backbone=None,
                 n_way=N_WAY, k_shot=K_SHOT, n_query=N_QUERY):
        super().__init__()
        self.n_way, self.k_shot, self.n_query = n_way, k_shot, n_query
        self.feature = Conv4() if backbone is None else backbone
        self.ATTN = Attention(dim, heads, dim_head, cosine)
        self.proto_weight = nn.Parameter(torch.ones(n_way, k_shot, 1))
        self.FFN = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))
        last = CosineDistLinear(dim_head, 1) if cosine else nn.Linear(dim_head, 1)
        self.linear = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim_head), last)

    def forward(self, images):
        z = self.feature(images).reshape(self.n_way, self.k_shot + self.n_query, -1)
        support = z[:, :self.k_shot]
        query = z[:, self.k_shot:].reshape(self.n_way * self.n_query, -1)
        proto = (support * torch.softmax(self.proto_weight, dim=-2)).sum(1).unsqueeze(0)
        query = query.unsqueeze(1)
        x = self.ATTN(proto, query, query) + proto
        x = self.FFN(x) + x
        return self.linear(x).squeeze(-1)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    images = torch.randn(N_WAY * (K_SHOT + N_QUERY), 3, SIZE, SIZE)
    targets = torch.arange(N_WAY).repeat_interleave(N_QUERY)
    for variant in ["cosine", "softmax"]:
        torch.manual_seed(1)
        model = FSCT(variant == "cosine").train()
        weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
                   if not k.endswith("num_batches_tracked")}
        scores = model(images)
        loss = F.cross_entropy(scores, targets, reduction="sum")
        loss.backward()
        grads = {k: p.grad.contiguous() for k, p in model.named_parameters() if p.grad is not None}
        d = os.path.join(OUT, variant)
        os.makedirs(d, exist_ok=True)
        save_file(weights, os.path.join(d, "model.safetensors"))
        save_file({"images": images, "scores": scores.detach().contiguous(),
                   "loss": loss.detach().reshape(1)}, os.path.join(d, "episode.safetensors"))
        save_file(grads, os.path.join(d, "grads.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"n_way": N_WAY, "k_shot": K_SHOT, "n_query": N_QUERY, "image_size": SIZE,
                       "backbone": "conv4", "method": "fsct_" + variant, "torch": torch.__version__}, f)
        print(variant, "loss", loss.item(), "params", len(grads))


if __name__ == "__main__":
    main()
