"""Tiny models and tokenizers built in the test (never the cached, trained zoo)."""
import pytest
import torch

from heterofold.registry import adapter_for, family, family_names
from heterofold.tokenizer import TextTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "grep searches the named input files for lines containing a match to the given pattern.",
    "Return a new sorted list from the items in iterable; the sort is stable and ascending.",
    "A library for reading and writing archives: tar, cpio, zip and ISO9660 images.",
    "Naïve café owners résumé their work; 12345 users tried foo_bar(x) in 2024.",
] * 4


# Every registered family at its test size (heterofold/registry.py), in registration order (a family's seed is its
# index): a new family is picked up by every test parametrized over `family_names()`.
TINY = {name: family(name).tiny_spec() for name in family_names()}


@pytest.fixture(scope="session")
def texts():
    return TEXTS


@pytest.fixture(scope="session")
def tiny_specs():
    return TINY


@pytest.fixture(scope="session")
def tokenizers():
    """Each family's own tokenizer; families of one tokenizer kind share one (it would be built identically)."""
    kinds = {spec.tokenizer for spec in TINY.values()}
    built = {kind: TextTokenizer.build(kind, TEXTS, 300) for kind in sorted(kinds)}
    return {name: built[spec.tokenizer] for name, spec in TINY.items()}


@pytest.fixture(scope="session")
def tiny_models(tokenizers):
    torch.set_num_threads(1)
    out = {}
    for i, (name, spec) in enumerate(TINY.items()):
        model = spec.build(tokenizers[name].vocab_size, seed=i, max_positions=512, attn="eager")
        out[name] = adapter_for(model, spec)
    return out


def build_served_root(root, tokenizers, sender: str = "llama", receiver: str = "qwen3"):
    """A tiny zoo (the TINY specs, 300 training steps each, a few seconds) and one map `sender-to-receiver`, laid out as
    `heterofold fit` lays out the real ones: what the serving tests serve. Returns the map's folder."""
    from heterofold import mapfile, zoo
    from heterofold.calibrate import FitConfig, collect, fit

    torch.set_num_threads(1)
    models = {}
    for i, family in enumerate((sender, receiver)):
        spec, tok = TINY[family], tokenizers[family]
        model = spec.build(tok.vocab_size, seed=i)
        zoo.train(model, tok, TEXTS, zoo.TrainConfig(steps=300, batch=8, seq_len=64, vocab_size=300, seed=i),
                  desc=f"tiny {family}")
        zoo.save(zoo.ZooModel(spec, model, tok), root / "zoo" / family)
        models[family] = zoo.load(family, root)          # fingerprints as the server will compute them
    S, R = models[sender], models[receiver]
    samples = collect(S.adapter, R.adapter, S.tok, R.tok, TEXTS[:8])
    m, _ = fit(S.adapter, R.adapter, samples[:6], samples[6:], FitConfig(epochs=1), progress=False)
    out = root / "maps" / f"{sender}-to-{receiver}"
    mapfile.save(m, out, mapfile.fingerprint(S.adapter, S.tok), mapfile.fingerprint(R.adapter, R.tok), "tiny-calib")
    return out


@pytest.fixture(scope="session")
def served_root(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("heterofold_served")
    build_served_root(root, tokenizers)
    return root
