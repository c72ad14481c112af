"""The real Triton server: gRPC streaming, generate and generate_stream; a multi-turn conversation
switching adapters gives the in-process engine's tokens; bad requests get clear errors and the server serves on."""

from __future__ import annotations

import json
import queue
import shutil
import urllib.error
import urllib.request
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ced import CEDEngine, CEDForCausalLM
from ced.tokenization import ChatTokenizer


def post(ports, path, body) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{ports.http_url}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


def generate(ports, **fields) -> dict:
    return post(ports, "/v2/models/mol2/generate", fields)


def in_process_turns(served_dir, turns: list[tuple[str, str]], max_tokens: int) -> list[str]:
    engine = CEDEngine(CEDForCausalLM.from_pretrained(served_dir / "model"))
    for name in ("chat", "coding"):
        engine.adapters.load(name, served_dir / "adapters" / name)
    tokenizer, state, texts = ChatTokenizer(served_dir / "model"), engine.new_conversation(), []
    for text, adapter in turns:
        logits = engine.turn(state, tokenizer.user_turn(tokenizer.encode(text), state.length == 0),
                             None if adapter == "base" else adapter).logits
        ids = list(engine.generate(state, None if adapter == "base" else adapter, logits, max_tokens))
        texts.append(tokenizer.decode(ids))
    return texts


def test_multi_turn_switching_matches_the_engine(server, served_dir):
    turns = [("hello there", "chat"), ("write a loop", "coding"), ("and now?", "base"), ("thanks", "chat")]
    expected = in_process_turns(served_dir, turns, max_tokens=6)
    conversation, answers = None, []
    for text, adapter in turns:
        fields = dict(text_input=text, adapter=adapter, max_tokens=6)
        if conversation:
            fields["conversation_id"] = conversation
        answer = generate(server, **fields)
        assert "error" not in answer, answer
        assert answer["applied_adapter"] == adapter
        conversation = answer["conversation_id_out"]
        answers.append(answer["text_output"])
    assert answers == expected


def test_grpc_streaming(server):
    # Triton's HTTP /infer refuses decoupled models ("HTTP end point doesn't support models with decoupled
    # transaction policy"): over HTTP, generate and generate_stream are the way in.
    responses: queue.Queue = queue.Queue()
    stream = grpcclient.InferenceServerClient(server.grpc_url)
    stream.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), responses))
    grpc_inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
                   grpcclient.InferInput("adapter", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32")]
    grpc_inputs[0].set_data_from_numpy(np.array([b"stream me"], dtype=object))
    grpc_inputs[1].set_data_from_numpy(np.array([True]))
    grpc_inputs[2].set_data_from_numpy(np.array([b"chat"], dtype=object))
    grpc_inputs[3].set_data_from_numpy(np.array([4], dtype=np.int32))
    stream.async_stream_infer("mol2", grpc_inputs, enable_empty_final_response=True)
    finals, received = 0, 0
    while not finals:
        result, error = responses.get(timeout=120)
        assert error is None, error
        received += 1
        finals += result.get_response().parameters["triton_final_response"].bool_param
    stream.stop_stream()
    assert received >= 1


def test_a_decoupled_model_sends_only_the_outputs_asked_for(server):
    """The engine builds every output but sends only those requested: Triton's Python backend would drop the rest
    inside `send` without the GIL, which corrupted the engine's heap under load (python_backend/triton/triton_io.py)."""
    responses: queue.Queue = queue.Queue()
    stream = grpcclient.InferenceServerClient(server.grpc_url)
    stream.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), responses))
    inputs = [grpcclient.InferInput("prompt", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("max_tokens", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([b"only these"], dtype=object))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([3], dtype=np.int32))
    wanted = ["text_output", "finish_reason"]
    stream.async_stream_infer("engine", inputs, outputs=[grpcclient.InferRequestedOutput(name) for name in wanted],
                              enable_empty_final_response=True)
    names, final = [], False
    while not final:  # streamed: one response per token, then the last with FINAL
        result, error = responses.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        names.append(sorted(output.name for output in response.outputs))
    stream.stop_stream()
    assert len(names) >= 2 and names == [sorted(wanted)] * len(names), names


def stream_events(ports, model="mol2", **fields) -> list[dict]:
    """The server-sent events of one generate_stream request."""
    request = urllib.request.Request(f"http://{ports.http_url}/v2/models/{model}/generate_stream", method="POST",
                                     data=json.dumps(dict(fields, stream=True)).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        return [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]


def test_generate_stream_sends_events(server):
    events = stream_events(server, text_input="go", adapter="chat", max_tokens=4)
    assert events and all(event["applied_adapter"] == "chat" for event in events)
    assert [event["output_tokens"] for event in events[:-1]] == list(range(1, len(events)))  # one event a token


@pytest.mark.parametrize("fields, message", [
    (dict(text_input="hi", adapter="nope"), "unknown adapter 'nope'"),
    (dict(text_input="hi", adapter="/etc/passwd"), "unknown adapter '/etc/passwd'"),
    (dict(text_input="", adapter="chat"), "text_input is empty"),
    (dict(text_input="hi", adapter="chat", conversation_id="never-started"), "unknown conversation_id"),
    (dict(text_input="hi", adapter="chat", max_tokens="x"), ""),
    (dict(text_input="x" * 5000, adapter="chat"), "over the context limit"),
])
def test_bad_requests_get_clear_errors(server, fields, message):
    answer = generate(server, **fields)
    assert "error" in answer and message in answer["error"], answer
    assert "error" not in generate(server, text_input="still serving?", adapter="chat", max_tokens=2)


@pytest.mark.parametrize("name, values, kind, message", [
    ("max_tokens", np.array([4.0], dtype=np.float32), "FP32", "expects 'INT32'"),
    ("text_input", np.array([b"one", b"two"], dtype=object), "BYTES", "unexpected shape for input 'text_input'"),
])
def test_wrong_dtype_or_shape_over_grpc(server, name, values, kind, message):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    fields = {"text_input": (np.array([b"hi"], dtype=object), "BYTES"), "adapter": (np.array([b"chat"], dtype=object),
                                                                                      "BYTES"), name: (values, kind)}
    inputs = []
    for field, (array, datatype) in fields.items():
        tensor = grpcclient.InferInput(field, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("mol2", inputs)
    result, error = responses.get(timeout=120)
    client.stop_stream()
    assert error is not None and message in str(error), (result, error)
    assert "error" not in generate(server, text_input="still serving?", adapter="chat", max_tokens=2)


def test_malformed_json(server):
    answer = post(server, "/v2/models/mol2/generate", b"{not json")
    assert "failed to parse the request JSON" in answer["error"]


def test_end_conversation_frees_the_state(server, served_dir):
    first = generate(server, text_input="remember me", adapter="chat", max_tokens=2)
    conversation = first["conversation_id_out"]
    assert (served_dir / "conversations" / f"{conversation}.state").exists()
    generate(server, text_input="bye", adapter="chat", max_tokens=2, conversation_id=conversation,
             end_conversation=True)
    assert not (served_dir / "conversations" / f"{conversation}.state").exists()
    assert "unknown conversation_id" in generate(server, text_input="back?", adapter="chat",
                                                 conversation_id=conversation)["error"]


def test_counters_written_read_applied(server):
    """One turn's decision is counted once written (routed), once read (the engine took its adapter) and once
    applied (its replay ran): each total grows by one. (Totals since start differ by the turns that failed after
    routing, which other tests cause on purpose.)"""
    def totals():
        with urllib.request.urlopen(f"http://{server.host}:{server.metrics}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        found = dict.fromkeys(("mol2_routes_written", "mol2_routes_read", "mol2_routes_applied"), 0.0)
        for line in metrics.splitlines():
            for name in found:
                if line.startswith(name + "{"):
                    found[name] += float(line.rsplit(" ", 1)[1])
        return found

    before = totals()
    generate(server, text_input="count me", adapter="coding", max_tokens=2)
    after = totals()
    assert {name: after[name] - before[name] for name in after} == dict.fromkeys(after, 1.0)


def test_hot_adapter_update_mid_conversation(server, served_dir):
    """Pointing `chat` at another adapter directory takes effect on the next turn, without a restart."""
    set_file = served_dir / "adapter_set.json"
    original = set_file.read_text()

    def start():
        return generate(server, text_input="hello", adapter="chat", max_tokens=3)["conversation_id_out"]

    def again(conversation, adapter):
        answer = generate(server, text_input="again", adapter=adapter, max_tokens=6, conversation_id=conversation)
        assert "error" not in answer, answer
        return answer["text_output"]

    a, b, c = start(), start(), start()
    before = again(b, "chat")
    try:
        updated = json.loads(original)
        copy = served_dir / "adapters" / "coding_copy"   # a set gives each entry a directory of its own
        shutil.copytree(served_dir / "adapters" / "coding", copy, dirs_exist_ok=True)
        updated["adapters"][0]["path"] = "adapters/coding_copy"  # "chat" now serves the coding adapter's weights
        set_file.write_text(json.dumps(updated))
        after = again(a, "chat")
        assert after == again(c, "coding") and after != before
    finally:
        set_file.write_text(original)
    assert again(start(), "chat") == before  # rolled back


def test_a_second_adapter_set_is_served_side_by_side(server):
    ours = generate(server, text_input="same question", adapter="coding", max_tokens=5)
    theirs = post(server, "/v2/models/mol2_alt/generate",
                  dict(text_input="same question", adapter="alt_coding", max_tokens=5))
    assert theirs["applied_adapter"] == "alt_coding" and theirs["text_output"] == ours["text_output"]
    refused = post(server, "/v2/models/mol2_alt/generate", dict(text_input="q", adapter="coding", max_tokens=2))
    assert "unknown adapter 'coding'" in refused["error"]


def test_bounded_load_every_answer_equals_its_serial_run(server, served_dir):
    """32 conversations at once, 3 turns each, mixed adapters; then every conversation ends."""
    from concurrent.futures import ThreadPoolExecutor

    store = served_dir / "conversations"
    before = sorted(p.name for p in store.glob("*.state"))
    adapters = ["chat", "coding", "base"]
    scripts = {n: [(f"conversation {n} turn {t}", adapters[(n + t) % 3]) for t in range(3)] for n in range(32)}

    def run(n):
        conversation, texts = None, []
        for turn, (text, adapter) in enumerate(scripts[n]):
            fields = dict(text_input=text, adapter=adapter, max_tokens=4, end_conversation=turn == 2)
            if conversation:
                fields["conversation_id"] = conversation
            answer = generate(server, **fields)
            assert "error" not in answer, answer
            conversation = answer["conversation_id_out"]
            texts.append(answer["text_output"])
        return texts

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(run, range(32)))
    for n in (0, 1, 2, 17, 31):  # serial runs of a sample, in process
        assert answers[n] == in_process_turns(served_dir, scripts[n], max_tokens=4), n
    assert sorted(p.name for p in store.glob("*.state")) == before
    assert not list(store.glob("*.lock"))


def test_concurrent_turns_on_one_conversation_are_refused_not_interleaved(server):
    from concurrent.futures import ThreadPoolExecutor

    conversation = generate(server, text_input="start", adapter="chat", max_tokens=2)["conversation_id_out"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda i: generate(server, text_input=f"racing {i}", adapter="coding", max_tokens=40,
                                                   conversation_id=conversation), range(4)))
    served = [a for a in answers if "error" not in a]
    refused = [a for a in answers if "error" in a]
    assert served and all("already has a turn in progress" in a["error"] for a in refused)
    assert "error" not in generate(server, text_input="after the race", adapter="chat", max_tokens=2,
                                   conversation_id=conversation)


def metric_totals(server, names) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{server.host}:{server.metrics}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
            for name in names}


def test_mixed_explicit_and_routed_requests(server):
    """Concurrent turns, some naming an adapter and some routed: every explicit choice is kept, routed turns get
    an adapter of the set with its scores, and every decision written is read and applied."""
    from concurrent.futures import ThreadPoolExecutor

    names = ("mol2_routes_written", "mol2_routes_read", "mol2_routes_applied")
    before = metric_totals(server, names)
    explicit = ["chat", None, "coding", None, "base", None, "coding", None]
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda a: generate(server, text_input="route me please", max_tokens=2,
                                                   **({"adapter": a} if a else {})), explicit))
    for wanted, answer in zip(explicit, answers):
        assert "error" not in answer, answer
        scores = json.loads(answer["route_scores"])
        if wanted:
            assert answer["applied_adapter"] == wanted and scores == {}
        else:
            assert set(scores) == {"chat", "coding"} and answer["applied_adapter"] == max(scores, key=scores.get)
    after = metric_totals(server, names)
    delta = {name: after[name] - before[name] for name in names}
    assert delta["mol2_routes_written"] == delta["mol2_routes_read"] == delta["mol2_routes_applied"] == len(explicit)



def test_sampling_controls_reach_the_engine_and_bad_ones_are_named(server):
    """min_p, the penalties, min_tokens and stop_token_ids are inputs of the ensemble: they change the answer, and a
    value out of range is a 400 naming its field (it was accepted and ignored before)."""
    fields = dict(text_input="tell me about the weather", adapter="chat", max_tokens=12, ignore_eos=True)
    plain = generate(server, **fields)["text_output"]
    assert generate(server, **fields, repetition_penalty=3.0, frequency_penalty=2.0)["text_output"] != plain
    assert generate(server, **fields, min_p=0.0, presence_penalty=0.0, min_tokens=0, stop_token_ids=[]
                    )["text_output"] == plain  # the no-op values change nothing
    stopped = generate(server, **fields, stop_token_ids=list(range(1, 9000)))  # every token stops: one comes out
    assert stopped["output_tokens"] == 1, stopped
    for field, value in (("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("min_p", 2.0), ("min_tokens", -1)):
        answer = generate(server, **fields, **{field: value})
        assert field in answer.get("error", ""), answer
