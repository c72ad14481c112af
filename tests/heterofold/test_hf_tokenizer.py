"""The real tokenizers report character end offsets that tile the text; compact ids round-trip; an unknown
tokenizer name is refused, naming the known ones."""
import pytest

from heterofold.registry import family_names
from heterofold.tokenizer import TOKENIZERS, TextTokenizer, UnknownTokenizer

TEXT = "Héllo wörld, the café is open. 12345 x=foo(y)  \n  z — end"


@pytest.mark.parametrize("name", family_names())
def test_end_offsets_tile_the_text(tokenizers, texts, name):
    tok = tokenizers[name]
    ids, ends = tok.encode(TEXT)
    assert len(ids) == len(ends) and ends[-1] == len(TEXT)
    assert all(a <= b for a, b in zip(ends[:-1], ends[1:]))
    assert tok.decode(tok.ids(texts[0])) == texts[0]


def test_tokenizers_differ(tokenizers, texts):
    splits = {n: tuple(t.encode(texts[1])[1]) for n, t in tokenizers.items()}
    assert len(set(splits.values())) >= 2
    assert len({t.fingerprint() for t in tokenizers.values()}) == len({t.name for t in tokenizers.values()})


def test_an_unknown_tokenizer_is_refused_by_name(tmp_path, texts):
    """It once fell back to Qwen's silently."""
    known = ", ".join(TOKENIZERS)
    with pytest.raises(UnknownTokenizer, match=f"unknown tokenizer 'gpt2': the known tokenizers are {known}"):
        TextTokenizer.build("gpt2", texts)
    (tmp_path / "keep_ids.json").write_text('{"name": "gpt2", "keep_ids": [1, 2]}')
    with pytest.raises(UnknownTokenizer, match="unknown tokenizer 'gpt2'"):
        TextTokenizer.load(tmp_path)
