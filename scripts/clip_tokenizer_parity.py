#!/usr/bin/env python3
"""Fixture for the CLIP tokenizer (run by hand; transformers 4.57.1):

    python scripts/clip_tokenizer_parity.py      # writes tests/fixtures/clip_tokenizer/

SDXL ships its two tokenizers as vocab.json + merges.txt (no tokenizer.json). This writes a small
byte-level BPE vocabulary in that layout (every byte, every byte with the end-of-word marker,
the merges that spell a few caption words, CLIP's two special tokens) and records what
transformers' CLIPTokenizer and CLIPTokenizerFast make of some captions, padded to 16 tokens
with each of SDXL's two pad tokens (`<|endoftext|>` for tokenizer/, `!` for tokenizer_2/).
"""
import json
import os

from transformers import CLIPTokenizer, CLIPTokenizerFast
from transformers.models.clip.tokenization_clip import bytes_to_unicode

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "clip_tokenizer")
WORDS = ["a", "photo", "of", "red", "circle", "square", "blue", "the", "on", "white", "background", "cat's"]
CASES = ["a photo of a red circle", "A  Blue SQUARE, on the white background!", "the cat's 42 photos",
         "unseen wörds stay byte-level", "", "a " * 20]


def main():
    os.makedirs(OUT, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab = {}
    for c in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(c, len(vocab))
    merges = []
    for w in WORDS:
        symbols = list(w)
        symbols[-1] += "</w>"
        cur = symbols[0]
        for s in symbols[1:]:
            pair = f"{cur} {s}"
            if pair not in merges:
                merges.append(pair)
            cur += s
            vocab.setdefault(cur, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(OUT, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(OUT, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    out = {"max_length": 16, "cases": []}
    for pad in ["<|endoftext|>", "!"]:
        slow = CLIPTokenizer(os.path.join(OUT, "vocab.json"), os.path.join(OUT, "merges.txt"), pad_token=pad)
        fast = CLIPTokenizerFast(os.path.join(OUT, "vocab.json"), os.path.join(OUT, "merges.txt"), pad_token=pad)
        for text in CASES:
            a = slow(text, padding="max_length", max_length=16, truncation=True).input_ids
            b = fast(text, padding="max_length", max_length=16, truncation=True).input_ids
            assert a == b, (text, a, b)
            out["cases"].append({"pad": pad, "text": text, "ids": a})
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print("written", OUT)


if __name__ == "__main__":
    main()
