"""Internal models called directly (their inputs prefixed `_`, on the ports every client reaches): without a seal
of this server's secret they are refused with a 400 before the store is touched, so another's conversation is
neither read, locked, unlocked nor overwritten; errors on their inputs are 400, never 500."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from ced import CEDConfig
from python_backend.core.seal import DECODE, PREFILL, Sealer, decode_fields, prefill_fields
from python_backend.core.store import ConversationStore
from python_backend.core.transfer import encode_state

from test_triton import generate


def call(server, model: str, inputs: list[dict], endpoint: str = "infer") -> tuple[int, str]:
    """(HTTP status, body) of one request; decoupled models take their inputs as generate fields."""
    if endpoint == "infer":
        body = {"inputs": inputs}
    else:
        body = {spec["name"]: spec["data"][0] if spec["shape"] == [1] else spec["data"] for spec in inputs}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{endpoint}", method="POST",
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def tensor(name: str, datatype: str, data: list, shape: list[int] | None = None) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape or [len(data)], "data": data}


@pytest.fixture()
def bystander(server, served_dir):
    """Someone else's conversation: its record's bytes, and a check that its turn lock is free."""
    conversation = generate(server, text_input="mine", adapter="chat", max_tokens=3)["conversation_id_out"]
    record = served_dir / "conversations" / f"{conversation}.state"
    before = record.read_bytes()

    def untouched() -> None:
        assert record.read_bytes() == before
        # free: another process (this one) can take its turn lock at once
        probe = ConversationStore(record.parent, CEDConfig.from_name("tiny"))
        probe.begin_turn(conversation)
        probe.end_turn(conversation)

    yield conversation, untouched
    generate(server, text_input="bye", conversation_id=conversation, max_tokens=1, end_conversation=True)


def forged_seals(purpose: str, fields: dict) -> list[str | None]:
    """No seal, an empty one, one of another secret over the very same fields, and random hex."""
    return [None, "", Sealer(os.urandom(32)).seal(purpose, **fields), "ab" * 32]


def test_a_direct_prefill_cannot_read_or_lock_a_conversation(server, bystander):
    conversation, untouched = bystander
    ids = [104, 105]
    for route_only in (False, True):
        for seal in forged_seals(PREFILL, prefill_fields(conversation, route_only, ids)):
            inputs = [tensor("_text_ids", "INT64", ids), tensor("conversation_id", "BYTES", [conversation]),
                      tensor("_route_only", "BOOL", [route_only])]
            if seal is not None:
                inputs.append(tensor("_seal", "BYTES", [seal]))
            status, body = call(server, "prefill", inputs)
            assert status == 400 and "_seal" in body, body
            assert "_state" not in body  # nothing of the conversation came back
    untouched()


def test_a_direct_decode_cannot_overwrite_or_unlock_a_conversation(server, served_dir, bystander):
    conversation, untouched = bystander
    other = generate(server, text_input="other", adapter="coding", max_tokens=3)["conversation_id_out"]
    # A real state of the same model, as prefill would send it (the other conversation's, encoded for transfer).
    config = CEDConfig.from_name("tiny")
    loaded = ConversationStore(served_dir / "conversations", config).load(other)
    state, length = encode_state(loaded, config), loaded.length
    meta = [length, 0]
    for return_state in (False, True):
        fields = decode_fields(conversation, length, 0, state, return_state, False)
        for seal in forged_seals(DECODE, fields):
            inputs = [tensor("_state", "UINT8", list(state)), tensor("_routed_meta", "INT64", meta),
                      tensor("_conversation_id", "BYTES", [conversation]), tensor("_route_scores", "BYTES", ["{}"]),
                      tensor("_return_state", "BOOL", [return_state]), tensor("max_tokens", "INT32", [2])]
            if seal is not None:
                inputs.append(tensor("_seal", "BYTES", [seal]))
            status, body = call(server, "decode", inputs, endpoint="generate")
            assert status == 400 and "_seal" in body, body
    untouched()
    generate(server, text_input="bye", conversation_id=other, max_tokens=1, end_conversation=True)


def test_a_direct_router_touches_no_conversation_and_refuses_bad_inputs(server, served_dir, bystander):
    conversation, untouched = bystander
    holder = ConversationStore(served_dir / "conversations", CEDConfig.from_name("tiny"))
    holder.begin_turn(conversation)  # someone's turn is running
    try:
        status, body = call(server, "router", [tensor("_h19", "FP32", [0.5] * 3), tensor("_transfer_meta", "INT64",
                                                                                            [3, 0])])
        assert status == 400 and "_h19 must hold 64 values" in body, body  # was a 500 (a shape error in the head)
        status, body = call(server, "router", [tensor("_h19", "FP32", [0.5] * 64), tensor("_transfer_meta", "INT64",
                                               [3, 0]), tensor("_conversation_id", "BYTES", [conversation])])
        assert status == 400, body  # the router takes no conversation id: it can end no one's turn
        assert "already has a turn in progress" in generate(server, text_input="x", conversation_id=conversation,
                                                            max_tokens=1)["error"]  # still held by its turn
    finally:
        holder.end_turn(conversation)
    untouched()


def test_the_route_model_still_answers(server, bystander):
    """The route model seals its own prefill request: a decision comes back, the conversation is unchanged."""
    conversation, untouched = bystander
    status, body = call(server, "route", [tensor("text_input", "BYTES", ["route me"]),
                                          tensor("conversation_id", "BYTES", [conversation])])
    assert status == 200 and json.loads(body)["outputs"][0]["name"] == "adapter", body
    untouched()
