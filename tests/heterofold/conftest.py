"""Tiny models and tokenizers built in the test (never the cached, trained zoo)."""
from dataclasses import replace

import pytest
import torch

from heterofold.families import FAMILIES, Adapter
from heterofold.tokenizer import TextTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "grep searches the named input files for lines containing a match to the given pattern.",
    "Return a new sorted list from the items in iterable; the sort is stable and ascending.",
    "A library for reading and writing archives: tar, cpio, zip and ISO9660 images.",
    "Naïve café owners résumé their work; 12345 users tried foo_bar(x) in 2024.",
] * 4


def tiny(name: str, **kw):
    base = dict(layers=2, hidden=32, heads=4, intermediate=64)
    base.update(kw)
    return replace(FAMILIES[name], **base)


TINY = {
    "llama": tiny("llama", kv_heads=2, head_dim=8),
    "qwen3": tiny("qwen3", layers=3, kv_heads=1, head_dim=12),
    "mistral": tiny("mistral", kv_heads=2, head_dim=6),
}


@pytest.fixture(scope="session")
def texts():
    return TEXTS


@pytest.fixture(scope="session")
def tiny_specs():
    return TINY


@pytest.fixture(scope="session")
def tokenizers():
    return {"llama": TextTokenizer.build("bpe", TEXTS, 300), "qwen3": TextTokenizer.build("qwen", TEXTS, 300),
            "mistral": TextTokenizer.build("cl100k", TEXTS, 300)}


@pytest.fixture(scope="session")
def tiny_models(tokenizers):
    torch.set_num_threads(1)
    out = {}
    for i, (name, spec) in enumerate(TINY.items()):
        model = spec.build(tokenizers[name].vocab_size, seed=i, max_positions=512, attn="eager")
        out[name] = Adapter(model, spec)
    return out
