"""The served adapter set's route prompt reaches the option side: scores equal the reference head on embeddings of
"<set prompt> name: description"; a set whose prompt is the trained one, or a set file without one, scores as the
trained prompt does; the option side is computed once per (prompt, candidates) and reused when sets alternate."""

from __future__ import annotations

import json

import pytest
import torch

from mol2_router import Candidate, MoL2Router, PointerHead, RouterConfig, RouteTokenizer
from mol2_router.data import RouteDataError
from mol2_router.features import ROUTE_PROMPT, option_tokens, pad_batch
from python_backend.core.adapter_set import parse_adapter_set

CANDIDATES = (Candidate("chat", "small talk and jokes"), Candidate("agent", "shell commands and tools"),
              Candidate("coding", "python code"))


def adapter_set(tmp_path, prompt, candidates=CANDIDATES, name="set.json"):
    record = {"adapters": [{"name": c.name, "path": f"adapters/{c.name}", "description": c.description}
                           for c in candidates]}
    if prompt is not None:
        record["route_prompt"] = prompt
    (tmp_path / name).write_text(json.dumps(record))
    return parse_adapter_set(tmp_path / name)


@pytest.fixture()
def router():
    torch.manual_seed(0)
    head = PointerHead(RouterConfig.from_name("tiny"))
    embedding = torch.randn(262, head.config.hidden_size)
    return MoL2Router(head, embedding, RouteTokenizer("bytes"), CANDIDATES)


def reference(router, pooled, prompt, candidates=CANDIDATES):
    """The uncached head on the option tokens of `prompt`: what the set's scores must be."""
    ids = [option_tokens(router.tokenizer, c.option_text(), router.config.max_option_tokens, route_prompt=prompt)
           for c in candidates]
    ids, lengths = pad_batch(ids)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        return router.head(pooled[None], torch.nn.functional.embedding(ids, router.embedding), mask)[0]


def test_the_trained_prompt_scores_exactly_as_before(router, tmp_path):
    pooled = torch.randn(router.config.hidden_size)
    before = router.score_pooled(pooled)  # the cache built at construction, with the trained prompt
    served = router.score_adapter_set(pooled, adapter_set(tmp_path, ROUTE_PROMPT))
    assert torch.equal(torch.tensor(list(served.values())), before)
    assert router.prompt == ROUTE_PROMPT


def test_the_set_prompt_reaches_the_option_side(router, tmp_path):
    pooled = torch.randn(router.config.hidden_size)
    prompt = "Best fit:"
    served = router.score_adapter_set(pooled, adapter_set(tmp_path, prompt))
    assert list(served) == [c.name for c in CANDIDATES] and router.prompt == prompt
    got = torch.tensor(list(served.values()))
    torch.testing.assert_close(got, reference(router, pooled, prompt), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, reference(router, pooled, ROUTE_PROMPT))
    assert router.route_prompt == ROUTE_PROMPT  # the trained prompt is still what save() records


def test_a_set_file_without_a_prompt_falls_back_to_the_trained_one(router, tmp_path):
    served_set = adapter_set(tmp_path, None)
    assert served_set.route_prompt == ""
    pooled = torch.randn(router.config.hidden_size)
    router.score_adapter_set(pooled, adapter_set(tmp_path, "Another prompt:", name="other.json"))
    served = router.score_adapter_set(pooled, served_set)
    torch.testing.assert_close(torch.tensor(list(served.values())), reference(router, pooled, ROUTE_PROMPT),
                               rtol=1e-5, atol=1e-5)
    assert router.prompt == ROUTE_PROMPT


def test_option_side_is_computed_once_per_set(router, tmp_path, monkeypatch):
    calls = []
    encode = router.head.encode_options
    monkeypatch.setattr(router.head, "encode_options", lambda *a, **k: calls.append(1) or encode(*a, **k))
    one = adapter_set(tmp_path, "First prompt:", name="one.json")
    two = adapter_set(tmp_path, "Second prompt:", CANDIDATES[:2], name="two.json")
    pooled = torch.randn(router.config.hidden_size)
    first = router.score_adapter_set(pooled, one)
    for _ in range(3):
        assert router.score_adapter_set(pooled, two).keys() == {"chat", "agent"}
        assert router.score_adapter_set(pooled, one) == first
    assert len(calls) == 2


def test_an_over_long_set_prompt_is_refused_naming_the_option(router, tmp_path):
    with pytest.raises(RouteDataError, match="option 'chat'"):
        router.score_adapter_set(torch.randn(router.config.hidden_size), adapter_set(tmp_path, "x" * 200))
