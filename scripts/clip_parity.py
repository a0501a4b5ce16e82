#!/usr/bin/env python3
"""Parity fixtures for the CLIP text encoders (run by hand, results committed):

    pip install torch "transformers==4.57.1" safetensors
    python scripts/clip_parity.py      # writes tests/fixtures/clip_tiny/

Two tiny encoders in SDXL's two flavours: CLIPTextModel (quick_gelu, legacy eos_token_id 2:
pooled at the highest id) and CLIPTextModelWithProjection (gelu, pooled at the first EOS,
projected). For fixed token ids it records every hidden state, the final-normed last hidden
state, the pooled output, and the gradient of every parameter for
sum(w1 * pooled) + sum(w2 * hidden_states[-2]).
"""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

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


if __name__ == "__main__":
    main()
