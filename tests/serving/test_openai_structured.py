"""Structured output, tool calls and logprobs on the OpenAI port, driven by the official `openai` SDK and LangChain
against the real tritonserver (the tiny random model: whatever it would write, the grammar makes it valid):
response_format json_schema / json_object, vLLM's guided extras, each tool_choice (forced calls parse, `none` never
calls), streamed tool-call deltas, a history with a tool's result, logprobs; plus the tool-call parser alone."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from python_backend.server.openai_api import OpenAIServer, OpenAISettings
from python_backend.server.openai_api.schema import ChatCompletionRequest
from python_backend.server.openai_api.tools import ToolDeltas, ToolUse

HELLO = [{"role": "user", "content": "hello there, how are you?"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def front(server, served_dir):
    app = OpenAIServer(OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json"),
                       port=0).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(front):
    return OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages=HELLO, **fields):
    return client.chat.completions.create(model="chat", messages=messages, **{"max_tokens": 200, "temperature": 0.0,
                                                                              **fields})


# -- structured output ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [None, 1, 2])
def test_response_format_json_schema_answers_json_that_validates(client, seed):
    sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
    answer = chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}, **sampled)
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    assert answer.choices[0].finish_reason == "stop"  # complete: ended by the grammar, no stop token needed


def test_the_sdks_parse_helper_gets_its_pydantic_model(client):
    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)

    parsed = client.chat.completions.parse(model="coding", messages=HELLO, response_format=Pet, max_tokens=100,
                                           temperature=0.0).choices[0].message.parsed
    assert isinstance(parsed, Pet)


def test_json_object_answers_an_object(client):
    answer = chat(client, response_format={"type": "json_object"}, max_tokens=300)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_guided_extras_change_the_answer_to_what_they_allow(client):
    free = chat(client, max_tokens=12).choices[0].message.content
    choices = ["red alert", "all clear"]
    chosen = chat(client, extra_body={"guided_choice": choices}).choices[0].message.content
    assert chosen in choices and free not in choices
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", chat(client, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{4}"})
                        .choices[0].message.content)
    grammar = 'root ::= "x=" [0-9] ("+" [0-9])?'
    assert re.fullmatch(r"x=[0-9](\+[0-9])?", chat(client, extra_body={"guided_grammar": grammar})
                        .choices[0].message.content)
    assert chat(client, extra_body={"structured_outputs": {"choice": choices}}).choices[0].message.content in choices
    guided = chat(client, extra_body={"guided_json": PERSON}).choices[0].message.content
    jsonschema.validate(json.loads(guided), PERSON)


def test_completions_take_the_same_constraints(client):
    answer = client.completions.create(model="chat", prompt="The code is", max_tokens=20, temperature=0.0,
                                       extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", answer.choices[0].text) and answer.choices[0].finish_reason == "stop"
    answer = client.completions.create(model="chat", prompt="A person:", max_tokens=200, temperature=0.0,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON}}})
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)


@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema", 'Unsupported type "objec"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "parenthesis"),
    ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar", "EBNF"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "guided_choice", "only one constraint"),
    ({"extra_body": {"structured_outputs": {"choice": ["a"], "regex": "b"}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"structured_outputs": {"whitespace_pattern": " "}}}, "structured_outputs.whitespace_pattern",
     "Extra inputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "only one constraint"),
])
def test_a_malformed_or_doubled_constraint_is_a_400_naming_its_field(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **fields)
    assert refused.value.param == param and says in refused.value.message, refused.value.message


# -- tools ---------------------------------------------------------------------------------------------------------

def valid_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


@pytest.mark.parametrize("model", ["chat", "coding", "mol2"])
def test_tool_choice_required_gives_a_parsed_call(client, model):
    answer = client.chat.completions.create(model=model, messages=HELLO, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0.0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in PARAMETERS
    valid_call(choice.message.tool_calls[0])


def test_a_named_tool_choice_calls_that_tool(client):
    answer = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    call, = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and valid_call(call)["zone"] in ("UTC", "CET")


def test_tool_choice_none_never_calls_and_auto_answers_text_or_calls(client):
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != "tool_calls"
    auto = chat(client, tools=TOOLS, max_tokens=24).choices[0]
    for call in auto.message.tool_calls or []:
        valid_call(call)
    assert auto.finish_reason == ("tool_calls" if auto.message.tool_calls else auto.finish_reason)
    assert auto.message.tool_calls or auto.message.content is not None


def test_streamed_tool_calls_come_as_deltas(client):
    stream = client.chat.completions.create(model="chat", messages=HELLO, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0.0, stream=True)
    calls, reasons, content = {}, [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        reasons.append(choice.finish_reason)
    assert list(calls) == [0] and reasons[-1] == "tool_calls" and content == ""
    whole = chat(client, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls[0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS[calls[0]["name"]])


def test_a_history_with_a_tool_result_is_rendered_and_answered(client, front):
    call = chat(client, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls[0]
    history = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=16)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    request = urllib.request.Request(f"{front.url}/tokenize", json.dumps({"model": "chat", "messages": history}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        tokens = json.loads(response.read())["tokens"]
    rendered = bytes(t for t in tokens if t < 256).decode()  # the tiny model's tokenizer: UTF-8 bytes
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": ' in rendered
    assert rendered.endswith("<tool_response>sunny, 21 C</tool_response>")


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "n": 2}, "n"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **fields)
    assert refused.value.param == param, refused.value.message


# -- logprobs ------------------------------------------------------------------------------------------------------

def test_chat_logprobs_report_each_token_and_its_alternatives(client):
    answer = chat(client, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens == 8
    for entry in entries:  # greedy: the token is the likeliest of its distribution
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = [entry for chunk in chat(client, max_tokens=8, logprobs=True, top_logprobs=3, stream=True,
                                        extra_body={"ignore_eos": True})
                for entry in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_logprobs_under_a_grammar_leave_only_what_it_allows(client):
    answer = chat(client, logprobs=True, top_logprobs=5, extra_body={"guided_choice": ["yes", "no"]})
    first = answer.choices[0].logprobs.content[0]
    possible = {t.token for t in first.top_logprobs if t.logprob > -9999}
    assert possible == {"y", "n"} and answer.choices[0].message.content in ("yes", "no")


def test_completions_logprobs(client):
    answer = client.completions.create(model="chat", prompt="Once", max_tokens=6, temperature=0.0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == answer.choices[0].text and all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


@pytest.mark.parametrize("create", [lambda c: chat(c, logprobs=True, top_logprobs=21),
                                    lambda c: c.completions.create(model="chat", prompt="x", logprobs=21)])
def test_more_than_20_alternatives_is_a_400(client, create):
    with pytest.raises(openai.BadRequestError) as refused:
        create(client)
    assert refused.value.param in ("top_logprobs", "logprobs")


# -- LangChain -----------------------------------------------------------------------------------------------------

def langchain_model(front):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{front.url}/v1", api_key="unused", model="chat", temperature=0.0, max_tokens=200,
                      max_retries=0)


def test_langchain_with_structured_output_gets_its_pydantic_model(front):
    class Answer(BaseModel):
        """An answer to the question."""

        verdict: Literal["yes", "no", "maybe"]
        confidence: int = Field(ge=0, le=100)

    result = langchain_model(front).with_structured_output(Answer).invoke("Is the sky blue?")
    assert isinstance(result, Answer)


def test_langchain_bind_tools_then_invoke_gets_a_tool_call(front):
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for a few days."""
        return "sunny"

    message = langchain_model(front).bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    call, = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert isinstance(call["args"]["days"], int)


# -- the parser alone ----------------------------------------------------------------------------------------------

def tool_use(**fields) -> ToolUse:
    return ToolUse(ChatCompletionRequest.model_validate({"model": "chat", "messages": HELLO, "tools": TOOLS,
                                                         **fields}))


def test_the_parser_splits_text_and_calls_and_leaves_what_is_not_a_call():
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = tool_use().split(f"Let me see. {call}")
    assert content == "Let me see. " and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert tool_use().split(unknown) == (unknown, [])  # not an offered tool: text
    assert tool_use().split("<tool_call>{broken") == ("<tool_call>{broken", [])  # cut by max_tokens: text
    assert len(tool_use().split(call + call)[1]) == 2
    assert len(tool_use(parallel_tool_calls=False).split(call + call)[1]) == 1
    assert tool_use(tool_choice="none").split(call) == (call, [])


def test_streamed_deltas_hold_back_only_what_may_open_a_call():
    deltas = ToolDeltas(tool_use())
    out = [d for piece in ["Hi <to", "ol_ca", 'll>{"name": "get_time", "arguments": {"zone": "CET"}}</tool', "_call>",
                           " bye <"] for d in deltas.feed(piece)] + deltas.flush()
    assert out[0] == {"content": "Hi "} and out[-2:] == [{"content": " bye "}, {"content": "<"}]
    assert out[1]["tool_calls"][0]["index"] == 0 and out[1]["tool_calls"][0]["function"]["name"] == "get_time"
    assert deltas.called
