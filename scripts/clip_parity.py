#!/usr/bin/env python3
"""Parity fixtures for the CLIP text encoders (run by hand, results committed):

    pip install torch "transformers==4.57.1" safetensors
    python scripts/clip_parity.py      # writes tests/fixtures/clip_tiny/

Two tiny encoders in SDXL's two flavours: CLIPTextModel (quick_gelu, legacy eos_token_id 2:
pooled at the highest id) and CLIPTextModelWithProjection (gelu, pooled at the first EOS,
projected). For fixed token ids it records every hidden state, the final-normed last hidden
state, the pooled output, and the gradient of every parameter for
sum(w1 * pooled) + sum(w2 * hidden_states[-2]).

And a tiny vision tower (CLIPVisionModelWithProjection, clip_tiny/vision): images in [-1, 1]
(one wider than tall, shrunk; one smaller, enlarged) preprocessed as sdxl-ft's CMMD does (shorter
side resized with torch's antialiased bilinear interpolation, center crop, OpenAI CLIP's mean and
std), the tower's last hidden state and image embeddings, and every parameter's gradient for
sum(w1 * image_embeds) + sum(w2 * last_hidden_state).
"""
import json
import os

import torch
from safetensors.torch import save_file
import torch.nn.functional as F
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPVisionConfig,
                          CLIPVisionModelWithProjection)

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "clip_tiny")


def main():
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (2, 10))
    ids[0, 6] = 98
    ids[0, 7:] = 0
    ids[1, 9] = 98
    for name, cls, extra in [
        ("clip_l", CLIPTextModel, dict(hidden_act="quick_gelu", eos_token_id=2)),
        ("clip_g", CLIPTextModelWithProjection, dict(hidden_act="gelu", eos_token_id=98, projection_dim=24)),
    ]:
        torch.manual_seed(1)
        cfg = CLIPTextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                             num_attention_heads=4, max_position_embeddings=16, bos_token_id=0,
                             pad_token_id=1, **extra)
        model = cls(cfg).float()
        out = model(input_ids=ids, output_hidden_states=True)
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
        w1 = torch.linspace(-1, 1, pooled.numel()).reshape(pooled.shape)
        w2 = torch.linspace(1, -1, out.hidden_states[-2].numel()).reshape(out.hidden_states[-2].shape)
        ((pooled * w1).sum() + (out.hidden_states[-2] * w2).sum()).backward()
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        tensors = {"input_ids": ids.to(torch.int64), "pooled": pooled.detach(), "w1": w1, "w2": w2,
                   "last_hidden_state": out.last_hidden_state.detach()}
        for i, h in enumerate(out.hidden_states):
            tensors[f"hidden_states.{i}"] = h.detach().contiguous()
        save_file(tensors, os.path.join(d, "outputs.safetensors"))
        save_file({k: p.grad.contiguous() for k, p in model.named_parameters() if p.grad is not None},
                  os.path.join(d, "grads.safetensors"))
        print(name, pooled.shape, len(out.hidden_states))
    vision()


MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).reshape(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).reshape(1, 3, 1, 1)


def preprocess(images, size):
    """Shorter side to `size` (antialiased bilinear), center crop, normalise."""
    _, _, h, w = images.shape
    short = min(h, w)
    rh, rw = round(h * size / short), round(w * size / short)
    x = F.interpolate((images + 1) / 2, size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
    top, left = (rh - size) // 2, (rw - size) // 2
    return (x[:, :, top:top + size, left:left + size] - MEAN) / STD


def vision():
    torch.manual_seed(2)
    wide = torch.rand(2, 3, 20, 28) * 2 - 1
    small = torch.rand(1, 3, 12, 12) * 2 - 1
    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4, projection_dim=24, hidden_act="quick_gelu")
    torch.manual_seed(3)
    model = CLIPVisionModelWithProjection(cfg).float()
    pixels = torch.cat([preprocess(wide, 16), preprocess(small, 16)], 0)
    out = model(pixel_values=pixels)
    w1 = torch.linspace(-1, 1, out.image_embeds.numel()).reshape(out.image_embeds.shape)
    w2 = torch.linspace(1, -1, out.last_hidden_state.numel()).reshape(out.last_hidden_state.shape)
    ((out.image_embeds * w1).sum() + (out.last_hidden_state * w2).sum()).backward()
    d = os.path.join(OUT, "vision")
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    save_file({"wide": wide, "small": small, "pixel_values": pixels.contiguous(), "w1": w1, "w2": w2,
               "image_embeds": out.image_embeds.detach().contiguous(),
               "last_hidden_state": out.last_hidden_state.detach().contiguous()},
              os.path.join(d, "outputs.safetensors"))
    save_file({k: p.grad.contiguous() for k, p in model.named_parameters() if p.grad is not None},
              os.path.join(d, "grads.safetensors"))
    print("vision", out.image_embeds.shape, out.last_hidden_state.shape)


if __name__ == "__main__":
    main()
