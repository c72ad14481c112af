"""Stateless detokenization: the deltas of a streamed turn add up to the text of all its ids, partial UTF-8
characters held back until complete, however the ids were split into responses."""

from ced.tokenization import ByteTokenizer
from python_backend.core.detokenize import text_delta, window

decode = ByteTokenizer().decode


def stream(ids: list[int]) -> list[str]:
    deltas = [text_delta(decode, window(ids[:n], 1), 1, False) for n in range(1, len(ids) + 1)]
    return deltas + [text_delta(decode, window(ids, 0), 0, True)]


def test_streamed_deltas_add_up_and_hold_partial_characters():
    text = "héllo → wörld ✓ 𝄞 end"
    ids = list(text.encode())
    deltas = stream(ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    arrow = ids.index(0xE2)  # "→" is three bytes: nothing shows until the third
    assert deltas[arrow] == deltas[arrow + 1] == "" and deltas[arrow + 2] == "→"


def test_one_aggregated_response_and_a_cut_character_at_the_end():
    ids = list("abc€".encode())
    assert text_delta(decode, window(ids, len(ids)), len(ids), True) == "abc€"
    cut = ids[:-1]  # generation stopped inside "€": the final flush shows what there is
    assert "".join(stream(cut)) == decode(cut)


def test_a_bad_fresh_count_is_refused():
    import pytest

    with pytest.raises(ValueError, match="_fresh is 5"):
        text_delta(decode, [1, 2], 5, False)
