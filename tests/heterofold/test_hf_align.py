"""Token alignment by character end offsets on hand-made tokenizations, index pairing, and layer alignment."""
import numpy as np

from heterofold import align


def test_exact_boundaries_pair_one_to_one():
    # "ab cd": sender ["ab", " cd"] ends [2, 5]; receiver ["ab", " cd"] ends [2, 5]
    assert align.token_alignment([2, 5], [2, 5]).tolist() == [0, 1]


def test_many_to_one_takes_nearest_earlier_shared_boundary():
    # text "unbelievable!": sender ["unbeliev", "able", "!"] ends [8, 12, 13]
    # receiver ["un", "believ", "able", "!"] ends [2, 8, 12, 13]; "un" ends at 2, no shared boundary before it
    s, r = [8, 12, 13], [2, 8, 12, 13]
    assert align.token_alignment(s, r).tolist() == [0, 0, 1, 2]
    # receiver splits a sender token: ["unbeliev"] = ["unbe", "liev"] -> the second matches, first has none before
    # receiver ["ab", "cdef", "gh", "ij"] ends [2, 6, 8, 10] vs sender ["abcd", "efgh", "ij"] ends [4, 8, 10]:
    # "cdef" (6) has no match; nearest earlier shared boundary: none (2 and 4 are not shared) -> first sender token
    assert align.token_alignment([4, 8, 10], [2, 6, 8, 10]).tolist() == [0, 0, 1, 2]
    # after a shared boundary, an unmatched receiver token reuses it (no averaging of the sender tokens it spans)
    assert align.token_alignment([3, 9, 12], [3, 5, 7, 9, 12]).tolist() == [0, 0, 0, 1, 2]


def test_leading_mismatch_uses_first_sender_token():
    assert align.token_alignment([5, 9], [1, 2, 3, 9]).tolist() == [0, 0, 0, 1]


def test_index_pairing_and_misalignment():
    assert align.index_pairing(3, 5).tolist() == [0, 1, 2, 2, 2]
    s, r = [4, 8, 10], [2, 6, 8, 10]
    assert align.char_misalignment(s, r, align.token_alignment(s, r)) <= align.char_misalignment(
        s, r, align.index_pairing(3, 4))


def test_multiplicity_weights():
    assert np.allclose(align.multiplicity_weights(np.array([0, 0, 1, 2, 2, 2])), [0.5, 0.5, 1, 1 / 3, 1 / 3, 1 / 3])


def test_layer_alignment_proportional_depth_and_neighbours():
    assert [align.proportional_layer(l, 4, 6) for l in range(4)] == [0, 2, 3, 5]   # 0, 5/3, 10/3, 5
    assert [align.proportional_layer(l, 32, 32) for l in (0, 13, 31)] == [0, 13, 31]
    assert align.sender_layers(10, 32, 40, (-4, 0, 4)) == [9, 13, 17]             # pi = round(10*39/31) = 13
    assert align.sender_layers(0, 4, 6) == [0, 4]                                  # clipped, duplicates dropped
    assert align.sender_layers(1, 4, 6, (0,)) == [2]
