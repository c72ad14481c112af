"""Families come from one registry: unknown names are refused naming the known ones, the defaults are its
benchmarked families, and every registered family saves, loads, sends and receives through the same code."""
from dataclasses import replace

import pytest
import torch

from heterofold import registry, zoo
from heterofold.calibrate import FitConfig, collect, fit
from heterofold.fold import transfer
from heterofold.registry import Family, UnknownFamily, adapter_for, directions, family, family_names

KNOWN = ", ".join(sorted(family_names()))


def test_an_unknown_family_is_refused_naming_the_registered_ones():
    with pytest.raises(UnknownFamily, match=f"unknown model family 'gpt2': the registered families are {KNOWN}"):
        family("gpt2")
    with pytest.raises(UnknownFamily, match="'gpt2'"):
        adapter_for(torch.nn.Linear(1, 1), replace(family("llama").spec, name="gpt2"))


def test_registration_refuses_a_duplicate_or_an_unknown_tokenizer():
    with pytest.raises(ValueError, match="'llama' is already registered"):
        registry.register(family("llama"))
    odd = replace(family("llama").spec, name="odd", tokenizer="gpt2")
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2': the known tokenizers are"):
        registry.register(Family(odd))
    assert "odd" not in family_names()


def test_the_defaults_are_the_benchmarked_families(monkeypatch):
    benchmarked = family_names(benchmarked_only=True)
    assert directions() == [(s, r) for s in benchmarked for r in benchmarked if s != r]
    assert all(family(n).benchmarked for n in benchmarked)
    monkeypatch.setattr(zoo, "load_or_train", lambda name, root: name)
    assert list(zoo.load_zoo()) == benchmarked


def test_a_family_outside_the_defaults_is_still_a_valid_direction():
    from heterofold.pipeline import parse_direction

    for name in family_names():
        other = next(n for n in family_names() if n != name)
        assert parse_direction(f"{name}:{other}") == (name, other)


def test_a_spec_asking_sizes_its_config_cannot_build_is_refused():
    """GPT-NeoX's config has no num_key_value_heads or head_dim: both follow from heads and hidden."""
    spec = family("gpt_neox").tiny_spec()
    for sizes in (dict(kv_heads=2), dict(head_dim=4)):
        with pytest.raises(ValueError, match=r"GPTNeoXConfig builds \(heads, kv_heads, head_dim\) = \(4, 4, 8\)"):
            replace(spec, **sizes).build(64)


@pytest.mark.parametrize("name", family_names())
def test_a_zoo_entry_saves_and_loads_through_its_family(tmp_path, tokenizers, tiny_specs, name):
    spec, tok = tiny_specs[name], tokenizers[name]
    model = spec.build(tok.vocab_size, seed=3)
    zoo.save(zoo.ZooModel(spec, model, tok), tmp_path / "zoo" / name)
    loaded = zoo.load(name, tmp_path)
    assert type(loaded.adapter) is family(name).adapter and loaded.spec == spec
    ids = torch.tensor([list(range(3, 20))])
    assert torch.allclose(loaded.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


@pytest.mark.parametrize("sender", family_names())
def test_every_family_sends_to_the_next_and_its_receiver_decodes(tiny_models, tokenizers, texts, sender):
    """Each family once as sender and once as receiver (the next in registration order): calibrate one epoch, map,
    install, decode. Shapes only; the installing itself is pinned by test_hf_install."""
    names = family_names()
    receiver = names[(names.index(sender) + 1) % len(names)]
    S, R = tiny_models[sender], tiny_models[receiver]
    samples = collect(S, R, tokenizers[sender], tokenizers[receiver], texts[:8])
    m, _ = fit(S, R, samples[:6], samples[6:], FitConfig(epochs=1), progress=False)
    assert all(l.k.A.shape == (len(l.sender_layers) * S.d_kv, R.d_kv) for l in m.layers)
    s0 = samples[0]
    cache = transfer(m, s0.sender, s0.pairs[:-1], R)
    assert cache.get_seq_length() == len(s0.pairs) - 1
    assert len(R.greedy(cache, 5, 3)) == 3

