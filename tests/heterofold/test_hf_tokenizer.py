"""The three real tokenizers report character end offsets that tile the text; compact ids round-trip."""
import pytest


TEXT = "Héllo wörld, the café is open. 12345 x=foo(y)  \n  z — end"


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_end_offsets_tile_the_text(tokenizers, texts, name):
    tok = tokenizers[name]
    ids, ends = tok.encode(TEXT)
    assert len(ids) == len(ends) and ends[-1] == len(TEXT)
    assert all(a <= b for a, b in zip(ends[:-1], ends[1:]))
    assert tok.decode(tok.ids(texts[0])) == texts[0]


def test_tokenizers_differ(tokenizers, texts):
    splits = {n: tuple(t.encode(texts[1])[1]) for n, t in tokenizers.items()}
    assert len(set(splits.values())) >= 2
    assert len({t.fingerprint() for t in tokenizers.values()}) == 3
