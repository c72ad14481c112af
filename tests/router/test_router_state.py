"""Routing writes no state: MoL2, MoL and Contextual MoL, called alike (`decide(query, options)`), leave the
conversation bitwise unchanged; an explicit adapter bypasses every head, per request."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from mol2_router import (Candidate, ContextualRouter, MoL2Router, MoLRouter, PointerHead, QKHead, RouteQuery,
                         RouterConfig, RouteTokenizer)
from mol2_router.features import turn_tokens

CANDIDATES = (Candidate("A1", "small talk and jokes"), Candidate("A2", "shell commands and tools"),
              Candidate("A3", "python code"))


def assert_bitwise_equal(a, b, path="state"):
    """Walk dataclasses, dicts and lists; every tensor equal with torch.equal (dtype and shape included)."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_bitwise_equal(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.fixture()
def conversation(engine):
    """Two turns (the second after a short reply), so windows, global KV and adapter-bound windows are all filled."""
    tok = RouteTokenizer("bytes")
    state = engine.new_conversation()
    first = engine.turn(state, [0] + turn_tokens(tok, "hello there, tell me a joke"), "A1")
    list(engine.generate(state, "A1", first.logits, 5))
    h19 = engine.prefill(state, turn_tokens(tok, "now list the files in my home directory please"))
    engine.replay(state, "A2")
    return state, h19, tok


def routers(engine, tok):
    torch.manual_seed(0)
    config = RouterConfig.from_name("tiny")
    return {
        "mol2": MoL2Router(PointerHead(config), engine.model.get_input_embeddings().weight, tok, CANDIDATES),
        "mol": MoLRouter(engine, tok, adapter="L0", max_tokens=6),  # its options come with each decision
        "contextual": ContextualRouter(engine, QKHead(config.hidden_size, config.d_model), tok),
    }


ROUTERS = ["mol2", "mol", "contextual"]


@pytest.mark.parametrize("name", ROUTERS)
def test_routing_leaves_the_state_bitwise_unchanged(engine, conversation, name):
    state, h19, tok = conversation
    router = routers(engine, tok)[name]
    before = copy.deepcopy(state)
    decision = router.decide(RouteQuery(h19, state), CANDIDATES)
    assert decision.routed and router.name == name
    assert_bitwise_equal(state, before)
    # and the conversation continues exactly as if no routing had happened
    logits, _ = engine.replay(state, "A3")
    expected, _ = engine.replay(before, "A3")
    assert torch.equal(logits, expected)


def test_mol_baseline_really_wrote_into_its_branch(engine, conversation):
    """The rollback is real: MoL's branch grows by the route prompt and the decoded tokens."""
    state, h19, tok = conversation
    mol = routers(engine, tok)["mol"]
    before = engine.stats.prefilled_positions
    mol.decide(RouteQuery(h19, state), CANDIDATES)
    assert engine.stats.prefilled_positions - before >= len(mol.prompt)
    assert state.length == len(state.shared.tokens)


@pytest.mark.parametrize("name", ROUTERS)
def test_explicit_adapter_bypasses_the_router(engine, conversation, name, monkeypatch):
    state, h19, tok = conversation
    router = routers(engine, tok)[name]

    def boom(*args, **kwargs):
        raise AssertionError("the router ran although the request named its adapter")

    for owner, verb in ((engine, "prefill"), (engine, "turn"), (router, "route"), (router, "route_batch")):
        monkeypatch.setattr(owner, verb, boom)
    query = RouteQuery(h19, state, explicit="A3")
    for decision in (router.decide(query, CANDIDATES), *router.decide_batch([query, query], CANDIDATES)):
        assert decision.adapter == "A3" and not decision.routed


@pytest.mark.parametrize("name, missing", [("mol2", "h19"), ("mol", "state"), ("contextual", "state"),
                                           ("contextual", "h19")])
def test_a_query_without_what_the_router_reads_is_named(engine, conversation, name, missing):
    state, h19, tok = conversation
    query = dataclasses.replace(RouteQuery(h19, state), **{missing: None})
    with pytest.raises(ValueError, match=f"the {name} router reads the query's {missing}"):
        routers(engine, tok)[name].decide(query, CANDIDATES)


@pytest.mark.parametrize("name", ROUTERS)
def test_the_options_of_each_decision_are_the_ones_chosen_from(engine, conversation, name):
    state, h19, tok = conversation
    router = routers(engine, tok)[name]
    router.decide(RouteQuery(h19, state), CANDIDATES)
    two = CANDIDATES[::2]
    decision = router.decide(RouteQuery(h19, state), two)
    assert router.candidates == two and decision.index < 2
    assert decision.adapter in {c.name for c in two} | ({None} if name == "mol" else set())  # MoL may name none
    if decision.scores is not None:
        assert decision.scores.shape == (2,)
    with pytest.raises(ValueError, match="no options"):
        router.decide(RouteQuery(h19, state), ())


def test_precedence_is_per_request_not_per_batch(engine, conversation):
    state, h19, tok = conversation
    router = routers(engine, tok)["mol2"]
    seen = []
    score = router.head.score

    def counting(pooled, cache, *args, **kwargs):
        seen.append(pooled.shape[0])
        return score(pooled, cache, *args, **kwargs)

    router.head.score = counting
    queries = [RouteQuery(h19), RouteQuery(h19[:3]), RouteQuery(explicit="A2"), RouteQuery(h19, explicit="A1")]
    decisions = router.decide_batch(queries, CANDIDATES)
    assert seen == [2]  # one head call, only the two rows without an explicit adapter
    assert [d.routed for d in decisions] == [True, True, False, False]
    assert [d.adapter for d in decisions][2:] == ["A2", "A1"]
    alone = router.decide(RouteQuery(h19), CANDIDATES)
    assert decisions[0].adapter == alone.adapter
    torch.testing.assert_close(decisions[0].scores, alone.scores)


def test_save_and_load_round_trip(engine, conversation, tmp_path):
    from mol2_router import load_router

    state, h19, tok = conversation
    router = routers(engine, tok)["mol2"]
    engine.model.save_pretrained(tmp_path / "model")
    router.save(tmp_path / "router", backbone=tmp_path / "model")
    loaded = load_router(tmp_path / "router")  # embedding read from the backbone named in config.json
    assert loaded.names == router.names
    torch.testing.assert_close(loaded.scores(h19), router.scores(h19), rtol=0, atol=0)
    served = loaded.score_adapter_set(h19.mean(0), _AdapterSet([_Entry(c.name, c.description) for c in CANDIDATES]))
    assert list(served) == ["A1", "A2", "A3"]


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    description: str


@dataclasses.dataclass(frozen=True)
class _AdapterSet:
    adapters: list
