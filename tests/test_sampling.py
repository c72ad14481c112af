"""The sampling controls a client may send (vLLM's and OpenAI's meanings): each changes the choice as it says, the
defaults change nothing, bad values are refused naming the field, and the engines' own loops honour them."""

from __future__ import annotations

import math

import pytest
import torch

from ced.engine import SamplingParams, draw, sample, shaped_logits

LOGITS = torch.tensor([2.0, 1.5, 1.0, -1.0, 0.5])


def test_the_defaults_shape_nothing():
    assert not SamplingParams().shapes_logits
    assert sample(LOGITS, SamplingParams()) == 0


@pytest.mark.parametrize("changed", [dict(temperature=0.7), dict(repetition_penalty=1.1), dict(min_tokens=2),
                                     dict(grammar='{"type": "json"}'), dict(logprobs=2)])
def test_only_a_plain_greedy_row_takes_the_batchs_argmax(changed):
    """The scheduler gives a decode step's argmax straight to plain greedy rows; anything else samples itself."""
    assert SamplingParams(temperature=0.0).plain_greedy
    assert not SamplingParams(**{"temperature": 0.0, **changed}).plain_greedy


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    shaped = shaped_logits(LOGITS, SamplingParams(repetition_penalty=2.0), context=[0, 3, 0], generated=[],
                           stop_ids=())
    assert shaped.tolist() == [1.0, 1.5, 1.0, -2.0, 0.5]  # 0 and 3 seen (once each, however often), the rest kept
    assert sample(LOGITS, SamplingParams(repetition_penalty=2.0), context=[0]) == 1  # the repeat loses to 1.5


def test_presence_and_frequency_penalties_count_the_output_only():
    sampling = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    shaped = shaped_logits(LOGITS, sampling, context=[1, 1, 1], generated=[0, 0, 2], stop_ids=())
    assert shaped.tolist() == pytest.approx([2.0 - 0.25 - 1.0, 1.5, 1.0 - 0.25 - 0.5, -1.0, 0.5])
    assert sample(LOGITS, sampling, generated=[0, 0, 2]) == 1


def test_min_tokens_makes_stop_tokens_impossible_until_reached():
    sampling = SamplingParams(min_tokens=2)
    assert sample(LOGITS, sampling, generated=[4], stop_ids={0}) == 1  # 0 is a stop token, one token is too few
    assert sample(LOGITS, sampling, generated=[4, 4], stop_ids={0}) == 0
    assert shaped_logits(LOGITS, sampling, (), [], {0, 99})[0] == -math.inf  # an id past the vocabulary is ignored


def test_min_p_drops_the_unlikely_tail():
    logits = torch.tensor([5.0, 4.9, -5.0, -5.0])
    drawn = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), torch.Generator().manual_seed(seed))
             for seed in range(200)}
    assert drawn == {0, 1}
    without = {sample(logits, SamplingParams(temperature=50.0), torch.Generator().manual_seed(seed))
               for seed in range(200)}
    assert without == {0, 1, 2, 3}  # at a temperature that makes the tail likely, it is drawn without min_p
    assert {sample(logits, SamplingParams(temperature=50.0, min_p=0.99), torch.Generator().manual_seed(seed))
            for seed in range(200)} == {0, 1}  # and not with it


def test_a_draw_follows_the_probabilities_and_never_takes_an_impossible_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])  # unnormalised sums work the same: scaled below
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs * 3.0, generator) for _ in range(20000)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    assert (counts / 20000).tolist() == pytest.approx(probs.tolist(), abs=0.015)  # ~4 standard deviations
    assert [draw(probs, torch.Generator().manual_seed(7)) for _ in range(3)] == [draw(probs, torch.Generator()
                                                                                       .manual_seed(7))] * 3
    assert draw(torch.tensor([0.0, 0.0, 1.0, 0.0]), generator) == 2


def test_a_draw_rounded_up_to_the_total_takes_the_last_possible_token(monkeypatch):
    from ced import engine

    monkeypatch.setattr(engine.torch, "rand", lambda *args, **kw: torch.ones(1, dtype=kw.get("dtype")))
    assert draw(torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0])) == 2  # not 4 (probability 0), not past the end


@pytest.mark.parametrize("values", [{"min_p": 1.5}, {"min_p": -0.1}, {"repetition_penalty": 0.0},
                                    {"repetition_penalty": math.inf}, {"presence_penalty": 2.5},
                                    {"frequency_penalty": -3.0}, {"min_tokens": -1}, {"stop_token_ids": (3, -1)}])
def test_bad_values_are_refused_naming_the_field(values):
    (field, value), = values.items()
    with pytest.raises(ValueError, match=f"^{field} must be "):
        SamplingParams(**values)


def test_the_engines_stop_at_stop_token_ids_and_not_before_min_tokens(engine):
    """CEDEngine.generate and BatchedEngine.generate (the serial paths) honour both, as the scheduler does."""
    from ced.batched import BatchedEngine

    prompt = [5, 6, 7, 8, 9, 10]
    state = engine.new_conversation()
    engine.prefill(state, prompt)
    logits, _ = engine.replay(state, None)
    free = list(engine.generate(state, None, logits, 8))
    assert len(free) == 8
    stop = free[2]
    first = free.index(stop)

    def run(sampling: SamplingParams, stop_tokens=()) -> list[int]:
        again = engine.new_conversation()
        engine.prefill(again, prompt)
        first_logits, _ = engine.replay(again, None)
        return list(engine.generate(again, None, first_logits, 8, sampling, stop_tokens))

    assert run(SamplingParams(stop_token_ids=(stop,))) == free[:first + 1]
    delayed = run(SamplingParams(min_tokens=first + 2), stop_tokens=(stop,))
    assert stop not in delayed[:first + 2] and len(delayed) >= first + 2

    batched = BatchedEngine(engine)
    row = batched.open()
    batched.prefill(row, prompt)
    (row_logits,), _ = batched.replay([row], [None])
    assert list(batched.generate(row, None, row_logits, 8, SamplingParams(stop_token_ids=(stop,)))) == free[:first + 1]
