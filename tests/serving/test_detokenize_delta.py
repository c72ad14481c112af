"""Stateless detokenization: the deltas of a streamed turn add up to the text of all its ids, partial UTF-8
characters held back until complete, however the ids were split into responses."""

import pytest

from ced.tokenization import ByteTokenizer
from python_backend.core.detokenize import check_ids, text_delta, window

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
    with pytest.raises(ValueError, match="_fresh is 5"):
        text_delta(decode, [1, 2], 5, False)


@pytest.mark.parametrize("ids", [[10 ** 9], [-1], [2 ** 62], [5, 8192]])
def test_ids_that_are_not_tokens_are_refused_by_name(ids):
    """What the relay checks before it decodes decode's ids (a tokenizer fed 2**62 raised an OverflowError)."""
    with pytest.raises(ValueError, match=r"_ids holds -?\d+, not a token id \(0 to 8191\)"):
        check_ids(ids, 8192)
    assert check_ids([0, 5, 8191], 8192) == [0, 5, 8191]
