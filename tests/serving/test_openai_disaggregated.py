"""The OpenAI API on a disaggregated pair's prefill server, driven by the official `openai` SDK: the same app as the
single server's, streaming to the `mol2` relay (prefill and route here, decode on the decode server). Chat and
completions answer what the single server answers, streamed or not, for an adapter, the base model and `auto`;
structured output, tools, logprobs and the Responses API work through the pair; what the pair refuses is a 400."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from openai import OpenAI

from python_backend.server.openai_api import OpenAIServer, OpenAISettings

from test_triton import generate

HELLO = [{"role": "user", "content": "hello there, how are you?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}


def post_status(ports, fields: dict) -> tuple[int, str]:
    """Triton's HTTP `generate` on the relay: the status and the body."""
    request = urllib.request.Request(f"http://{ports.http_url}/v2/models/mol2/generate",
                                     data=json.dumps(fields).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def start_front(grpc_url: str, served_dir, engine_model: str) -> OpenAIServer:
    return OpenAIServer(OpenAISettings(grpc_url, served_dir / "model", served_dir / "adapter_set.json",
                                       engine_model=engine_model), port=0).start()


@pytest.fixture(scope="module")
def fronts(server, disaggregated, served_dir):
    """(the pair's OpenAI API, the single server's), both in this process."""
    prefill, _ = disaggregated
    pair, single = start_front(prefill.grpc_url, served_dir, "mol2"), start_front(server.grpc_url, served_dir, "engine")
    yield pair, single
    pair.stop()
    single.stop()


@pytest.fixture(scope="module")
def pair(fronts):
    return OpenAI(base_url=f"{fronts[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single(fronts):
    return OpenAI(base_url=f"{fronts[1].url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, model="chat", messages=HELLO, **fields):
    return client.chat.completions.create(model=model, messages=messages,
                                          **{"max_tokens": 12, "temperature": 0.0, **fields})


@pytest.mark.parametrize("model", ["chat", "mol2", "auto"])
def test_a_chat_completion_answers_as_the_single_server(pair, single, model):
    split, whole = chat(pair, model), chat(single, model)
    assert split.choices[0].message.content == whole.choices[0].message.content
    assert split.model == whole.model  # the adapter that answered: routed alike for `auto`
    assert split.choices[0].finish_reason == whole.choices[0].finish_reason
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert split.usage.completion_tokens == whole.usage.completion_tokens
    assert split.usage.prompt_tokens_details.cached_tokens == 0  # the prefill server keeps no prefix cache


def test_a_streamed_chat_completion_sends_the_same_text(pair):
    stream = pair.chat.completions.create(model="coding", messages=HELLO, max_tokens=12, temperature=0.0,
                                          stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(pair, "coding").choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == 12 or chunks[-2].choices[0].finish_reason == "stop"


def test_a_completion_answers_as_the_single_server(pair, single):
    fields = dict(model="coding", prompt="def reverse(items):", max_tokens=10, temperature=0.0)
    split, whole = pair.completions.create(**fields), single.completions.create(**fields)
    assert split.choices[0].text == whole.choices[0].text
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens


def test_response_format_json_schema_answers_json_that_validates(pair):
    answer = chat(pair, max_tokens=200, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    assert answer.choices[0].finish_reason == "stop"


def test_a_required_tool_call_is_parsed(pair):
    answer = chat(pair, max_tokens=200, tools=[WEATHER], tool_choice="required")
    call, = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_logprobs_come_through_the_pair(pair, single):
    split, whole = (chat(client, logprobs=True, top_logprobs=2, max_tokens=4) for client in (pair, single))
    entries, expected = split.choices[0].logprobs.content, whole.choices[0].logprobs.content
    assert [e.token for e in entries] == [e.token for e in expected] and len(entries) == 4
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-4)


def test_a_responses_chain_answers_as_on_the_single_server(pair, single, disaggregated, served_dir):
    store = served_dir / "prefill-store"
    before = set(store.glob("*.state"))

    def chain(client) -> list:
        first = client.responses.create(model="chat", input="Cats nap.", max_output_tokens=4, temperature=0.0)
        second = client.responses.create(model="chat", input="Who naps?", previous_response_id=first.id,
                                         max_output_tokens=4, temperature=0.0)
        assert second.previous_response_id == first.id
        return [(r.output_text, r.usage.input_tokens, r.usage.output_tokens) for r in (first, second)]

    split = chain(pair)
    assert split == chain(single)
    assert split[1][1] < split[0][1] + split[0][2] + len("Who naps?")  # the second sent only its new input
    chains = set(store.glob("*.state")) - before  # the chain is a conversation in the prefill server's store
    assert len(chains) == 1
    for path in chains:  # ended, so the pair's store is left as this test found it
        ended = generate(disaggregated[0], text_input="bye", max_tokens=1, conversation_id=path.stem,
                         end_conversation=True)
        assert "error" not in ended, ended


def test_a_prompt_over_the_context_is_refused_with_a_400_and_the_pair_serves_on(pair):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(pair, messages=[{"role": "user", "content": "x" * 5000}], max_tokens=2)
    assert "4096" in str(refused.value)  # the tiny model's max_context
    assert chat(pair, max_tokens=2).choices[0].message.content is not None


def test_the_relay_passes_structured_output_on_for_a_conversations_turn(disaggregated):
    """Triton's `generate` on the relay: `structured_output` reaches the decode server (it was dropped before)."""
    spec = json.dumps({"type": "json_schema", "value": json.dumps(PERSON)})
    answer = generate(disaggregated[0], text_input="a person, please", adapter="chat", max_tokens=100,
                      structured_output=spec, end_conversation=True)
    assert "error" not in answer, answer
    jsonschema.validate(json.loads(answer["text_output"]), PERSON)


@pytest.mark.parametrize("fields, message", [
    (dict(messages=json.dumps(HELLO), conversation_id="c1"), "conversation_id cannot be given with messages"),
    (dict(adapter="chat"), "missing input: text_input"),
    (dict(messages="[{]"), "messages is not valid JSON"),
])
def test_the_relay_refuses_what_it_cannot_serve_with_a_400(disaggregated, fields, message):
    prefill, _ = disaggregated
    status, body = post_status(prefill, fields)
    assert status == 400 and message in body, body
