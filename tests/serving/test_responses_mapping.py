"""The Responses API's mapping without a server: a chain's turns render to exactly the tokens of its history sent
whole (demo tokenizer and UTF-8 bytes), which turn each response runs (continue, branch, store false, a head in
use), the store's cap, the request's checks, and n's derived seeds."""

from __future__ import annotations

import json

import pytest

from ced.tokenization import ChatTokenizer
from python_backend.core.settings import ROOT
from python_backend.server.openai_api.choices import choice_seed, check_n
from python_backend.server.openai_api.response_store import ResponseStore, StoredResponse, turn_ids
from python_backend.server.openai_api.responses_schema import ResponseRequest
from python_backend.server.openai_api.schema import APIError, ChatCompletionRequest, parse_body

DEMO = ChatTokenizer(ROOT / "models" / "demo" / "model")  # trained: <|bos|>, <|user|>, <|end|>, <|assistant|>


class Bytes(ChatTokenizer):
    def __init__(self):
        super().__init__(ROOT / "no-such-model")  # no tokenizer.json: UTF-8 bytes, no markers


def stored(store: ResponseStore, plan, answer: str, conversation: str, previous=None, instructions=None):
    response = StoredResponse(f"resp_{len(store)}_{conversation}", {}, previous, plan.added, answer, instructions,
                              conversation)
    store.add(response)
    return response


@pytest.mark.parametrize("tokenizer", [DEMO, Bytes()], ids=["demo", "bytes"])
def test_a_chain_sent_turn_by_turn_is_the_history_sent_whole(tokenizer):
    """What the engine holds after each stateful turn (its user_turn around our ids, then the reply and <|end|>)
    is what ChatTokenizer.render makes of the whole history: the stateful and stateless paths share prefixes."""
    turns = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}],
             [{"role": "user", "content": "And then?"}],
             [{"role": "system", "content": "Now in French."}, {"role": "user", "content": "Encore?"},
              {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "Merci."}]]
    replies = ["Hi.", "Then this."]
    end = [tokenizer.stop_ids[0]] if tokenizer.trained else []
    held, history = [], []
    for i, turn in enumerate(turns):
        held += tokenizer.user_turn(turn_ids(tokenizer, turn, first=i == 0), first=i == 0)
        history += turn
        assert held == tokenizer.render(history)[0]
        if i < len(replies):
            held += tokenizer.encode(replies[i]) + end
            history.append({"role": "assistant", "content": replies[i]})


def test_a_turn_must_begin_as_the_engine_wraps_it():
    with pytest.raises(ValueError, match="one turn"):
        turn_ids(DEMO, [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], first=False)


def test_which_turn_each_response_runs():
    store = ResponseStore(capacity=8)
    hello = [{"role": "user", "content": "hello"}]
    first = store.plan(None, hello, "Be brief.", store=True)
    assert first.kind == "start" and first.added == [{"role": "system", "content": "Be brief."}] + hello
    one = stored(store, first, "hi", "conv-a", instructions="Be brief.")

    # the head of its conversation: only the new input, the same instructions not sent again
    after = store.plan(one, [{"role": "user", "content": "more"}], "Be brief.", store=True)
    assert after.kind == "continue" and after.conversation_id == "conv-a"
    assert after.messages == [{"role": "user", "content": "more"}]
    two = stored(store, after, "sure", "conv-a", one, "Be brief.")

    # one is no longer the head: a branch starts a new conversation from the whole history
    branch = store.plan(one, [{"role": "user", "content": "other"}], None, store=True)
    assert branch.kind == "start"
    assert branch.messages == one.history() + [{"role": "user", "content": "other"}]
    assert one.history() == first.added + [{"role": "assistant", "content": "hi"}]

    # new instructions are added before the input
    changed = store.plan(two, hello, "Be long.", store=True)
    assert changed.kind == "continue" and changed.messages[0] == {"role": "system", "content": "Be long."}

    # store false: the whole history, stateless, whatever the previous response is
    unstored = store.plan(two, hello, None, store=False)
    assert unstored.kind == "stateless" and unstored.messages == two.history() + hello

    # a head whose turn is running is not sent another: that one branches
    store.claim("conv-a")
    assert store.plan(two, hello, None, store=True).kind == "start"
    store.release("conv-a", answered=False)  # cut off: the engine may have stored it, so two is no head now
    assert not store.is_head(two) and store.plan(two, hello, None, store=True).kind == "start"


def test_the_store_drops_the_oldest_past_its_cap_and_their_ancestors_stay_readable():
    store = ResponseStore(capacity=2)
    plan = store.plan(None, [{"role": "user", "content": "a"}], None, True)
    one = stored(store, plan, "1", "c")
    two = stored(store, store.plan(one, [{"role": "user", "content": "b"}], None, True), "2", "c", one)
    three = stored(store, store.plan(two, [{"role": "user", "content": "c"}], None, True), "3", "c", two)
    assert len(store) == 2
    with pytest.raises(APIError) as gone:
        store.get(one.id, "previous_response_id")
    assert gone.value.status == 400 and gone.value.code == "previous_response_not_found"
    assert store.get(three.id) is three and store.is_head(three)
    assert [m["content"] for m in three.history()] == ["a", "1", "b", "2", "c", "3"]
    with pytest.raises(APIError) as unknown:
        store.get("resp_nope")
    assert unknown.value.status == 404
    assert store.delete(three.id) and not store.delete(three.id)
    assert store.plan(two, [{"role": "user", "content": "d"}], None, True).kind == "start"  # its head was deleted


def body(**fields) -> ResponseRequest:
    return parse_body(ResponseRequest, json.dumps({"model": "chat", "input": "hi", **fields}).encode(), 64)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "assistant", "content": "hi"}]}, "input"),
    ({"input": ""}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_fields_it_cannot_honour_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as refused:
        body(**fields)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_input_items_and_their_no_op_values_are_accepted():
    request = body(input=[{"role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                                              {"type": "input_text", "text": "brief."}]},
                          {"type": "message", "role": "user", "content": "hi"},
                          {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                           "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
                          {"role": "user", "content": [{"type": "input_text", "text": "again"}]}],
                   tool_choice="auto", tools=[], include=[], truncation="disabled", parallel_tool_calls=True,
                   text={"format": {"type": "text"}}, metadata={"k": "v"})
    assert request.input_messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert request.store and request.token_limit == 256


def test_choice_seeds_are_derived_and_repeat():
    assert choice_seed(None, 3) is None and choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(8)]
    assert len(set(seeds)) == 8 and seeds == [choice_seed(7, i) for i in range(8)]
    assert all(0 <= seed < 2**63 for seed in seeds)
    check_n(8, 8)
    with pytest.raises(APIError) as many:
        check_n(9, 8)
    assert many.value.param == "n" and "8" in many.value.message


def test_n_is_at_least_one():
    with pytest.raises(APIError) as zero:
        parse_body(ChatCompletionRequest, b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "n": 0}',
                   64)
    assert zero.value.param == "n"
