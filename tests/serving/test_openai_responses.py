"""The Responses API and `n` > 1, driven by the official `openai` client against the real tritonserver: a response
plain, with instructions, with input items, streamed (OpenAI's events in order, numbered); a chain whose second
turn's prompt is only its new input (the state stays in the engine), a branch from an older response served from
the prefix cache, store=false leaving nothing to continue, GET and DELETE by id; n choices that differ when sampled,
repeat with a seed, and share their prompt through the prefix cache."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from openai import OpenAI

from ced.tokenization import ChatTokenizer
from python_backend.server.openai_api import OpenAIServer, OpenAISettings

EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done"]


@pytest.fixture(scope="module")
def front(server, served_dir):
    app = OpenAIServer(OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json",
                                      max_n=4), port=0).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(front):
    return OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(served_dir):
    return ChatTokenizer(served_dir / "model")


def respond(client, text="hello there, how are you?", model="chat", **fields):
    return client.responses.create(model=model, input=text, **{"max_output_tokens": 8, "temperature": 0.0, **fields})


# -- one response ------------------------------------------------------------------------------------------------

def test_a_plain_response(client, tokenizer):
    text = "a plain response, please"
    response = respond(client, text)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "chat"
    # the test model never says a stop token: its answers end at max_output_tokens, so "incomplete" (as OpenAI's)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    message, = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.input_tokens == len(tokenizer.render([{"role": "user", "content": text}])[0])
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert response.store is True and response.previous_response_id is None


def test_instructions_and_input_items_are_rendered_as_chat_messages(client, tokenizer):
    with_instructions = respond(client, "What is a list?", instructions="Answer in one word.")
    rendered = tokenizer.render([{"role": "system", "content": "Answer in one word."},
                                 {"role": "user", "content": "What is a list?"}])[0]
    assert with_instructions.usage.input_tokens == len(rendered)
    assert with_instructions.instructions == "Answer in one word."
    assert with_instructions.output_text != respond(client, "What is a list?").output_text  # they are read
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
             {"type": "message", "role": "user", "content": "Another?"}]
    answer = client.responses.create(model="coding", input=items, max_output_tokens=6, temperature=0.0)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}]
    assert answer.usage.input_tokens == len(tokenizer.render(history)[0]) and answer.model == "coding"


def test_a_streamed_response_sends_openais_events_in_order(client):
    text = "stream this one"
    whole = respond(client, text, store=False)
    events = list(respond(client, text, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == EVENTS[:4] + ["response.output_text.delta"] * deltas + EVENTS[5:] + \
        ["response.incomplete"]  # cut at max_output_tokens; a stop token's answer ends with response.completed
    assert [event.sequence_number for event in events] == list(range(len(events)))
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == whole.output_text == final.output_text
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == streamed and final.usage.output_tokens == 8
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert client.responses.retrieve(final.id).output_text == streamed  # stored, as a plain one is


# -- chains ------------------------------------------------------------------------------------------------------

def test_a_chain_keeps_its_state_in_the_engine_and_sends_only_the_new_input(client, tokenizer):
    first_input = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 4
    first = respond(client, first_input)
    second = respond(client, "Who naps?", previous_response_id=first.id)
    # the whole history would be ~330 tokens; the turn prefilled only its own (the test model's tokens are bytes)
    assert second.usage.input_tokens == len(tokenizer.user_turn(tokenizer.encode("Who naps?"), first=False)) == 9
    assert second.usage.input_tokens_details.cached_tokens == 0 and second.previous_response_id == first.id
    # the state is the history's: another first turn, the same second input, another answer
    other = respond(client, "A cat sleeps on the warm mat all afternoon. " * 4)
    assert respond(client, "Who naps?", previous_response_id=other.id).output_text != second.output_text
    third = respond(client, "And then?", previous_response_id=second.id)
    assert third.usage.input_tokens == len("And then?")

    # a branch from the first response (no longer its conversation's head): a new conversation whose first turn
    # is the whole history, its start found in the prefix cache
    branch = respond(client, "Who jumps?", previous_response_id=first.id)
    history = [{"role": "user", "content": first_input}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Who jumps?"}]
    assert branch.usage.input_tokens == len(tokenizer.render(history)[0])
    assert branch.usage.input_tokens_details.cached_tokens >= len(first_input)
    # and the chain goes on from its own head
    assert respond(client, "More?", previous_response_id=third.id).usage.input_tokens == len("More?")


def test_a_conversation_the_engine_ended_is_continued_from_the_history(front, client, server, tokenizer):
    """The engine ends a conversation idle past idle_timeout_s (or asked to end it): the next response after its
    head is served from the history in a new conversation, not refused."""
    first = respond(client, "remember the word lantern")
    conversation = front.app.state.responses.store.get(first.id).conversation_id
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/mol2/generate", data=json.dumps(
        {"text_input": "bye", "conversation_id": conversation, "max_tokens": 1, "end_conversation": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as ended:
        assert ended.status == 200
    second = respond(client, "Which word?", previous_response_id=first.id)
    history = [{"role": "user", "content": "remember the word lantern"},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Which word?"}]
    assert second.usage.input_tokens == len(tokenizer.render(history)[0])
    assert respond(client, "Sure?", previous_response_id=second.id).usage.input_tokens == len("Sure?")


def test_store_false_keeps_nothing_to_continue(client):
    kept = respond(client, "kept")
    unstored = respond(client, "not kept", store=False, previous_response_id=kept.id)
    assert unstored.store is False and unstored.usage.input_tokens > len("not kept")  # the history, resent
    with pytest.raises(openai.BadRequestError) as refused:
        respond(client, "after it", previous_response_id=unstored.id)
    assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # the stored one is still its conversation's head: store=false did not advance it
    assert respond(client, "next", previous_response_id=kept.id).usage.input_tokens == len("next")


def test_get_and_delete_by_id(client):
    created = respond(client, "keep this", metadata={"topic": "test"})
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.usage == created.usage and fetched.metadata == {"topic": "test"}
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_unsupported_fields_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as tools:
        respond(client, tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert tools.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(model="chat", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png", "detail": "auto"}]}])
    assert image.value.param == "input[0].content[0]"
    with pytest.raises(openai.NotFoundError):
        respond(client, model="no-such-adapter")


# -- n choices ---------------------------------------------------------------------------------------------------

def chat(client, content, **fields):
    return client.chat.completions.create(model="chat", messages=[{"role": "user", "content": content}],
                                          **{"max_tokens": 12, "extra_body": {"ignore_eos": True}, **fields})


def test_n_choices_differ_repeat_with_a_seed_and_share_the_prompt(client, tokenizer):
    prompt = "two choices of one unique prompt"
    length = len(tokenizer.render([{"role": "user", "content": prompt}])[0])
    two = chat(client, prompt, n=2, temperature=1.0, seed=11)
    assert [choice.index for choice in two.choices] == [0, 1]
    texts = [choice.message.content for choice in two.choices]
    assert texts[0] != texts[1]
    assert [c.message.content for c in chat(client, prompt, n=2, temperature=1.0, seed=11).choices] == texts
    assert chat(client, prompt, temperature=1.0, seed=11).choices[0].message.content == texts[0]  # choice 0 is n=1's
    usage = two.usage  # summed over the rows: the second found the whole prompt in the prefix cache
    assert usage.prompt_tokens == 2 * length and usage.completion_tokens == 24
    assert usage.prompt_tokens_details.cached_tokens >= length

    chunks = list(chat(client, prompt, n=2, temperature=1.0, seed=11, stream=True,
                       stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in (0, 1)]
    assert streamed == texts
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1] and chunks[-1].usage.completion_tokens == 24


def test_n_on_completions_and_over_the_maximum(client):
    answer = client.completions.create(model="coding", prompt="def f(x):", n=3, max_tokens=6, temperature=1.0,
                                       seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2] and answer.usage.completion_tokens == 18
    streamed = list(client.completions.create(model="coding", prompt="def f(x):", n=3, max_tokens=6,
                                              temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}))
    assert ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)] \
        == [c.text for c in answer.choices]
    with pytest.raises(openai.BadRequestError) as many:
        chat(client, "too many", n=5)  # this front end's max_n is 4
    assert many.value.param == "n" and "4" in many.value.message


def test_openapi_declares_the_responses_endpoints(front):
    with urllib.request.urlopen(f"{front.url}/openapi.json", timeout=30) as response:
        document = json.loads(response.read())
    schemas = document["components"]["schemas"]
    create = document["paths"]["/v1/responses"]["post"]
    body = schemas[create["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]
    assert {"model", "input"} <= set(body["required"]) and "previous_response_id" in body["properties"]
    assert {"400", "404", "413"} <= set(create["responses"])
    for method in ("get", "delete"):
        assert "404" in document["paths"]["/v1/responses/{response_id}"][method]["responses"]
    assert schemas["TextPart"]["properties"]["type"] != schemas["ResponseTextPart"]["properties"]["type"]  # both kept
