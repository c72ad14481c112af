"""Disaggregated serving: a prefill server and a decode server (two real tritonservers), the state between them
over Triton gRPC. Answers equal the single server's; the prefill server owns the store, the decode server none.
Also the route-only model (a client's own routing decision): it answers over HTTP infer and writes nothing."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from test_triton import generate, metric_totals, post, stream_events

TURNS = [("hello there", "chat"), ("route this one", None), ("write a loop", "coding"), ("and now?", "base"),
         ("route again", None)]


def conversation(ports, turns, model="mol2", end=True) -> list[dict]:
    answers, conversation_id = [], None
    for number, (text, adapter) in enumerate(turns):
        fields = dict(text_input=text, max_tokens=5)
        if adapter:
            fields["adapter"] = adapter
        if conversation_id:
            fields["conversation_id"] = conversation_id
        if end and number == len(turns) - 1:
            fields["end_conversation"] = True
        answer = post(ports, f"/v2/models/{model}/generate", fields)
        assert "error" not in answer, answer
        conversation_id = answer["conversation_id_out"]
        answers.append(answer)
    return answers


def comparable(answers: list[dict]) -> list[tuple]:
    return [(a["text_output"], a["applied_adapter"], a["replayed_tokens"], a["route_scores"]) for a in answers]


def test_disaggregated_equals_single_server(server, disaggregated, served_dir):
    prefill, decode = disaggregated
    single = conversation(server, TURNS)
    split = conversation(prefill, TURNS)
    assert comparable(split) == comparable(single)
    assert any(json.loads(a["route_scores"]) for a in split)  # routed turns were among them
    assert list((served_dir / "prefill-store").glob("*.state")) == []  # ended: the store is back to empty
    assert list((served_dir / "decode-store").glob("*")) == []  # the decode server never stores state


def test_disaggregated_keeps_state_on_the_prefill_server(disaggregated, served_dir):
    prefill, _ = disaggregated
    first = conversation(prefill, TURNS[:2], end=False)
    conversation_id = first[-1]["conversation_id_out"]
    assert (served_dir / "prefill-store" / f"{conversation_id}.state").is_file()
    assert not (served_dir / "prefill-store" / f"{conversation_id}.lock").exists()  # the turn lock was released
    ended = generate(prefill, text_input="bye", adapter="chat", max_tokens=2, conversation_id=conversation_id,
                     end_conversation=True)
    assert "error" not in ended, ended
    assert not (served_dir / "prefill-store" / f"{conversation_id}.state").exists()


def test_disaggregated_streams_and_sets(server, disaggregated):
    prefill, decode = disaggregated
    fields = dict(text_input="go", adapter="chat", max_tokens=4, end_conversation=True)
    linked = metric_totals(decode, ["mol2_link_tokens_total"])["mol2_link_tokens_total"]
    events = stream_events(prefill, **fields)
    # the relay's token link brought them (python_backend/triton/token_link.py)
    assert metric_totals(decode, ["mol2_link_tokens_total"])["mol2_link_tokens_total"] == linked + 4
    assert events and all(event["applied_adapter"] == "chat" for event in events)
    # the same text and count; the decode server sends the tokens that came while it was sending as one event
    same = lambda events: ("".join(e["text_output"] for e in events), events[-1]["output_tokens"])  # noqa: E731
    assert same(events) == same(stream_events(server, **fields))
    counts = [event["output_tokens"] for event in events[:-1]]
    assert counts == sorted(set(counts)) and counts[0] >= 1  # each event before the last adds tokens
    alt = post(prefill, "/v2/models/mol2_alt/generate", dict(text_input="hi", adapter="alt_coding", max_tokens=3))
    assert alt["applied_adapter"] == "alt_coding", alt


@pytest.mark.parametrize("fields, message", [
    (dict(text_input="hi", adapter="nope"), "unknown adapter 'nope'"),
    (dict(text_input="", adapter="chat"), "text_input is empty"),
    (dict(text_input="hi", adapter="chat", conversation_id="never-started"), "unknown conversation_id"),
])
def test_disaggregated_bad_requests(disaggregated, fields, message):
    prefill, _ = disaggregated
    answer = generate(prefill, **fields)
    assert "error" in answer and message in answer["error"], answer
    assert "error" not in generate(prefill, text_input="still serving?", adapter="chat", max_tokens=2)


def test_route_model_answers_over_http_infer_and_writes_nothing(server, served_dir):
    started = generate(server, text_input="keep me", adapter="chat", max_tokens=3)
    conversation_id = started["conversation_id_out"]
    record = served_dir / "conversations" / f"{conversation_id}.state"
    before = record.read_bytes()
    counted = metric_totals(server, ["mol2_routes_written"])
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["route me please"]},
                       {"name": "conversation_id", "shape": [1], "datatype": "BYTES", "data": [conversation_id]}]}
    answer = post(server, "/v2/models/route/infer", body)
    outputs = {output["name"]: output["data"][0] for output in answer["outputs"]}
    scores = json.loads(outputs["route_scores"])
    assert set(scores) == {"chat", "coding"} and outputs["adapter"] == max(scores, key=scores.get)
    assert record.read_bytes() == before  # the conversation's state is bitwise what it was
    assert metric_totals(server, ["mol2_routes_written"]) == counted  # a decision, not a write into a transfer
    # The routed turn that follows gets the same decision the route model gave.
    routed = generate(server, text_input="route me please", conversation_id=conversation_id, max_tokens=2,
                      end_conversation=True)
    assert routed["applied_adapter"] == outputs["adapter"]
    unknown = post(server, "/v2/models/route/infer", {"inputs": [
        {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]},
        {"name": "conversation_id", "shape": [1], "datatype": "BYTES", "data": ["never-started"]}]})
    assert "unknown conversation_id" in unknown["error"]
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/route/infer", method="POST", data=json.dumps(
        {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [""]}]}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400 and "text_input is empty" in refused.value.read().decode()  # the client's fault


def test_a_cancelled_turn_stops_and_stores_nothing(disaggregated, served_dir):
    """A client that cancels its stream mid-answer: the relay cancels the turn on the decode server, which stops at
    the next token, and the conversation stays as it was before the cancelled turn. (Through the single server's
    ensemble Triton 2.51 does not pass a cancellation on to a step already running, so there the turn completes.)"""
    server, _ = disaggregated
    conversation = generate(server, text_input="hello", adapter="chat", max_tokens=3)["conversation_id_out"]
    record, lock = (served_dir / "prefill-store" / f"{conversation}.{suffix}" for suffix in ("state", "lock"))
    before = record.read_bytes()
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    fields = {"text_input": np.array([b"again"], dtype=object), "conversation_id": np.array([conversation.encode()],
              dtype=object), "adapter": np.array([b"chat"], dtype=object), "stream": np.array([True]),
              "max_tokens": np.array([4000], dtype=np.int32)}
    inputs = []
    for name, value in fields.items():
        inputs.append(grpcclient.InferInput(name, [1], {np.bool_: "BOOL", np.int32: "INT32"}.get(value.dtype.type,
                                                                                                 "BYTES")))
        inputs[-1].set_data_from_numpy(value)
    client.async_stream_infer("mol2", inputs, enable_empty_final_response=True)
    for _ in range(2):
        result, error = responses.get(timeout=120)
        assert error is None, error
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 60
    while lock.exists():
        assert time.monotonic() < deadline, "the cancelled turn still holds its lock"
        time.sleep(0.05)
    assert record.read_bytes() == before          # nothing of the cancelled turn was stored
    answer = generate(server, text_input="and now", adapter="chat", max_tokens=2, conversation_id=conversation)
    assert "error" not in answer, answer


def transfer_counts(ports) -> dict[tuple[str, ...], float]:
    """The delta transfer's counters on a server's metrics port: (name, stage, direction or reason, kind) -> value."""
    with urllib.request.urlopen(f"http://{ports.host}:{ports.metrics}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    counts = {}
    for line in lines:
        found = re.match(r"^(mol2_transfer_\w+)\{(.*)\} (\S+)$", line)
        if found:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', found[2]))
            key = (found[1], labels["stage"], labels.get("direction", labels.get("reason", "")), labels.get("kind", ""))
            counts[key] = float(found[3])
    return counts


def counted_since(before: dict, after: dict) -> dict:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


def test_disaggregated_turns_send_deltas_of_a_size_independent_of_the_history(server, disaggregated):
    """A long first turn goes whole; every later short turn sends each way only what the other side lacks: bytes
    about equal per turn, far under the full state, and counted alike on both servers. Answers stay the single
    server's."""
    prefill, decode = disaggregated
    turns = [(" ".join(["a long opening turn of history"] * 20), "chat"), ("short one", "chat"),
             ("short two", "coding"), ("short six", None)]
    expected = comparable(conversation(server, turns, end=False))
    answers, conversation_id, per_turn = [], None, []
    for text_input, adapter in turns:
        before = (transfer_counts(prefill), transfer_counts(decode))
        fields = dict(text_input=text_input, max_tokens=5, **({"adapter": adapter} if adapter else {}),
                      **({"conversation_id": conversation_id} if conversation_id else {}))
        answer = post(prefill, "/v2/models/mol2/generate", fields)
        assert "error" not in answer, answer
        conversation_id = answer["conversation_id_out"]
        answers.append(answer)
        relay, served = (counted_since(b, transfer_counts(p)) for b, p in zip(before, (prefill, decode)))
        # the same bytes, each way, counted by the side that sent them and the side that received them
        assert {key[2:]: value for key, value in relay.items() if key[0] == "mol2_transfer_bytes_total"} == \
            {key[2:]: value for key, value in served.items() if key[0] == "mol2_transfer_bytes_total"}, (relay, served)
        per_turn.append(relay)
    assert comparable(answers) == expected
    first, *later = per_turn

    def bytes_of(counts, direction, kind):
        return counts.get(("mol2_transfer_bytes_total", "relay", direction, kind))

    full = bytes_of(first, "to_decode", "full")
    assert full and bytes_of(first, "to_prefill", "delta")
    sent = [bytes_of(counts, "to_decode", "delta") for counts in later]
    returned = [bytes_of(counts, "to_prefill", "delta") for counts in later]
    assert all(sent) and all(returned), per_turn
    assert max(sent) < full / 2 and max(sent) - min(sent) < 0.1 * max(sent), (full, sent)
    assert max(returned) - min(returned) < 0.1 * max(returned), returned
    assert not any(key[0] == "mol2_transfer_fallbacks_total" for counts in per_turn for key in counts), per_turn
    before = transfer_counts(prefill)
    assert "error" not in generate(prefill, text_input="bye", adapter="chat", max_tokens=2,
                                   conversation_id=conversation_id, end_conversation=True)
    last = counted_since(before, transfer_counts(prefill))  # the last turn's state is not sent back to be dropped
    assert bytes_of(last, "to_decode", "delta") and not bytes_of(last, "to_prefill", "delta"), last
    assert not bytes_of(last, "to_prefill", "full"), last


def test_disaggregated_falls_back_to_the_full_state_when_another_relay_wrote_the_turn(server, disaggregated):
    """A conversation continued through another set's relay (mol2_alt: another process, its own decode model): the
    relay that served it before finds the journal changed and sends the whole state, counted as a fallback; the
    answers are the single server's."""
    prefill, _ = disaggregated
    turns = [("hello", "chat", "mol2"), ("next", "chat", "mol2"), ("elsewhere", "alt_coding", "mol2_alt"),
             ("back again", "coding", "mol2")]
    results = {}
    for name, ports in (("single", server), ("split", prefill)):
        before, answers, conversation_id = transfer_counts(prefill), [], None
        for text_input, adapter, model in turns:
            fields = dict(text_input=text_input, adapter=adapter, max_tokens=4,
                          **({"conversation_id": conversation_id} if conversation_id else {}))
            answer = post(ports, f"/v2/models/{model}/generate", fields)
            assert "error" not in answer, answer
            conversation_id = answer["conversation_id_out"]
            answers.append(comparable([answer])[0])
        results[name] = answers, counted_since(before, transfer_counts(prefill))
        assert "error" not in generate(ports, text_input="bye", adapter="chat", max_tokens=1,
                                       conversation_id=conversation_id, end_conversation=True)
    assert results["split"][0] == results["single"][0]
    counted = results["split"][1]
    assert counted.get(("mol2_transfer_fallbacks_total", "relay", "store_changed", "")) == 1, counted
    assert counted.get(("mol2_transfer_bytes_total", "relay", "to_decode", "delta")), counted  # turn 2


def test_the_sampling_controls_travel_to_the_decode_server(server, disaggregated):
    """The relay passes the penalties, min_tokens and stop_token_ids on (a list among scalars): the pair answers
    as the single server does under the same settings."""
    prefill, _ = disaggregated
    fields = dict(text_input="tell me about the weather", adapter="chat", max_tokens=10, ignore_eos=True,
                  repetition_penalty=2.5, presence_penalty=1.0, min_tokens=3, stop_token_ids=[7, 11],
                  end_conversation=True)
    single, split = generate(server, **fields), generate(prefill, **fields)
    assert "error" not in split and split["text_output"] == single["text_output"], (single, split)
    long = dict(text_input="hi", adapter="chat", max_tokens=40, ignore_eos=True, end_conversation=True)
    assert generate(prefill, **long)["output_tokens"] == 40  # ignore_eos too (the relay dropped it before)
