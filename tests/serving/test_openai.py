"""The OpenAI-compatible front end, driven by the official `openai` client against the real tritonserver: chat and
completions streamed and not, `model` as adapter / base / auto / mol2:ADAPTER, usage and stop strings, OpenAI-shaped
4xx errors, adapters loaded and unloaded through the adapter-set file, a history reused across adapters from the
prefix cache with the stateful path's tokens, and the metrics; plus the stop matcher and metrics without a server."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from ced import CEDConfig, CEDForCausalLM
from ced.synthetic import make_random_adapter
from ced.tokenization import ChatTokenizer
from python_backend.server.openai_api import OpenAIServer, OpenAISettings
from python_backend.server.openai_api.generation import StopMatcher
from python_backend.server.openai_api.metrics import Metrics

HELLO = [{"role": "user", "content": "hello there, how are you?"}]


@pytest.fixture(scope="module")
def front(server, served_dir):
    app = OpenAIServer(OpenAISettings(server.grpc_url, served_dir / "model", served_dir / "adapter_set.json"),
                       port=0).start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(front):
    return OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(served_dir):
    return ChatTokenizer(served_dir / "model")


def post(base: str, path: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def chat(client, model="chat", messages=HELLO, **fields):
    fields = {"max_tokens": 12, "temperature": 0.0, **fields}
    return client.chat.completions.create(model=model, messages=messages, **fields)


# -- chat and completions ----------------------------------------------------------------------------------------

def test_models_lists_the_base_auto_and_each_adapter(client, server):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"mol2", "auto", "chat", "coding"}
    assert cards["mol2"].parent is None
    assert all(cards[name].parent == "mol2" for name in ("auto", "chat", "coding"))


@pytest.mark.parametrize("model, answered", [("chat", "chat"), ("mol2", "mol2"), ("mol2:coding", "coding"),
                                             ("auto", None)])
def test_chat_by_adapter_base_auto_and_prefixed_name(client, tokenizer, model, answered):
    answer = chat(client, model, max_tokens=6, extra_body={"ignore_eos": True})
    assert answer.model == answered if answered else answer.model in ("chat", "coding")  # the head picks one
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    usage = answer.usage
    assert usage.prompt_tokens == len(tokenizer.render(HELLO)[0])
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_adapters_answer_differently(client):
    texts = {model: chat(client, model, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].message.content
             for model in ("chat", "coding", "mol2")}
    assert len(set(texts.values())) == 3, texts  # `model` really selects the adapter


def test_streamed_chat_is_the_non_streamed_answer_in_pieces(client):
    whole = chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(chat(client, max_tokens=10, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert {c.model for c in chunks} == {"chat"}


def test_completions_streamed_and_not(client, tokenizer):
    prompt = "def reverse(items):"
    whole = client.completions.create(model="coding", prompt=prompt, max_tokens=8, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert whole.model == "coding" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.completion_prompt(prompt))
    streamed = list(client.completions.create(model="coding", prompt=prompt, max_tokens=8, temperature=0.0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_seeded_sampling_repeats(client):
    one, two = (chat(client, temperature=1.0, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
                for _ in range(2))
    assert one.choices[0].message.content == two.choices[0].message.content


def test_stop_strings_cut_the_answer_before_them(client):
    full = chat(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[6:8]
    assert len(stop) == 2, full
    cut = full[:full.find(stop)]
    answer = chat(client, max_tokens=24, stop=stop, extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == cut and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens < 24  # counted up to the stop string
    streamed = chat(client, max_tokens=24, stop=["never there", stop], stream=True, extra_body={"ignore_eos": True})
    pieces = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == cut
    assert [c.choices[0].finish_reason for c in pieces if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_concurrent_requests_are_in_flight_together(client):
    """Each stream's first token arrives before any stream ends: the front end does not serve them one by one."""
    firsts, ends = [], []

    def one(index: int) -> None:
        stream = chat(client, ("chat", "coding")[index % 2], [{"role": "user", "content": f"stream {index}"}],
                      max_tokens=48, stream=True, extra_body={"ignore_eos": True})
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        firsts.append(first or time.perf_counter())
        ends.append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(ends) == 4 and max(firsts) < min(ends)


# -- errors ------------------------------------------------------------------------------------------------------

def test_unknown_model_is_a_404_and_n_above_max_n_a_400(client):
    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, "no-such-adapter")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as several:
        chat(client, n=9)  # max_n: 8 by default (n > 1: test_openai_responses.py)
    assert several.value.param == "n" and "at most 8" in several.value.message


@pytest.mark.parametrize("body, param", [
    ({"model": "chat", "messages": HELLO, "max_tokens": "5"}, "max_tokens"),
    ({"model": "chat", "messages": HELLO, "temperature": 9}, "temperature"),
    ({"model": "chat", "messages": HELLO, "stream": "yes"}, "stream"),
    ({"model": "chat", "messages": HELLO, "stop": 3}, "stop"),
    ({"model": "chat", "messages": "hello"}, "messages"),
    ({"model": "chat", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "chat", "messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
    ({"model": "chat", "messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": HELLO}, "model"),
    ({"model": "chat", "messages": HELLO, "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "chat", "messages": HELLO, "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "chat", "messages": HELLO, "min_p": 1.5}, "min_p"),
    ({"model": "chat", "messages": HELLO, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": "chat", "messages": HELLO, "guided_json": {"type": "objec"}}, "guided_json"),
    ({"model": "chat", "messages": HELLO, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"model": "chat", "messages": HELLO, "logit_bias": {"5": 1}}, "logit_bias"),
])
def test_bad_fields_get_an_openai_error_naming_them(front, body, param):
    status, text = post(front.url, "/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", text
    assert set(error) == {"message", "type", "param", "code"} and param.split("[")[0] in error["message"]


@pytest.mark.parametrize("path, body, status", [("/v1/chat/completions", b'{"model": "chat", "messages": [', 400),
                                                ("/v1/completions", b"[1, 2]", 400),
                                                ("/v1/completions", {"model": "chat", "prompt": ["a", "b"]}, 400),
                                                ("/v1/no_such_endpoint", {}, 404)])
def test_malformed_bodies_and_unknown_routes(front, path, body, status):
    answer_status, text = post(front.url, path, body)
    assert answer_status == status and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}, text


def test_penalties_and_vllms_sampling_extras_change_the_answer(client, tokenizer):
    """presence / frequency penalties (OpenAI's) and repetition_penalty, min_p, min_tokens, stop_token_ids (vLLM's)
    reach the engine: each changes the answer as it says (they were refused, or accepted and ignored, before)."""
    fields = {"max_tokens": 16, "extra_body": {"ignore_eos": True}}
    plain = chat(client, **fields).choices[0].message.content
    assert chat(client, presence_penalty=2.0, frequency_penalty=2.0, **fields).choices[0].message.content != plain
    assert chat(client, max_tokens=16, extra_body={"ignore_eos": True, "repetition_penalty": 3.0}
                ).choices[0].message.content != plain
    assert chat(client, max_tokens=16, extra_body={"ignore_eos": True, "min_p": 0.0, "min_tokens": 0}
                ).choices[0].message.content == plain  # the no-op values
    ids = sorted(set(tokenizer.encode(plain)))  # the plain answer's tokens (as the text encodes again)
    stopped = chat(client, max_tokens=16, extra_body={"ignore_eos": True, "stop_token_ids": ids})
    assert stopped.usage.completion_tokens < 16 and stopped.choices[0].finish_reason == "stop"  # ignore_eos or not
    early = chat(client, max_tokens=16, extra_body={"min_tokens": 16})  # no stop token before 16
    assert early.usage.completion_tokens == 16


# -- adapters ----------------------------------------------------------------------------------------------------

@pytest.fixture()
def restored_set(served_dir):
    """The adapter set as the other tests know it, put back afterwards whatever the test did."""
    path = served_dir / "adapter_set.json"
    original = path.read_bytes()
    made = []
    yield made
    if path.read_bytes() != original:
        before = path.stat().st_mtime_ns
        path.write_bytes(original)
        if path.stat().st_mtime_ns <= before:  # the watchers compare mtimes
            os.utime(path, ns=(before + 1_000_000, before + 1_000_000))
    for folder in made:
        if folder.is_symlink():
            folder.unlink()
        else:
            shutil.rmtree(folder, ignore_errors=True)


def test_load_and_unload_adapters(front, client, server, served_dir, tmp_path, restored_set):
    root = served_dir / "adapters"
    copy, link, encoder = root / "chat_again", root / "sneaky", root / "encoder_lora"
    restored_set.extend([copy, link, encoder])  # removed afterwards
    shutil.copytree(root / "chat", copy)  # the chat adapter's weights in a folder of their own: answers as chat
    outside = tmp_path / "outside"
    shutil.copytree(root / "chat", outside)
    link.symlink_to(outside)
    make_random_adapter(CEDForCausalLM.from_ced(CEDConfig.from_name("tiny"), seed=0), encoder,
                        r"model\.layers\.0\.attn\.q_proj", rank=2)

    for path in (str(outside), "../adapters/../model", "sneaky"):
        status, text = post(front.url, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path})
        assert status == 400 and json.loads(text)["error"]["code"] == "path_not_allowed", text
    status, text = post(front.url, "/v1/load_lora_adapter", {"lora_name": "enc", "lora_path": str(encoder)})
    assert status == 400 and "model.layers.0.attn.q_proj" in text and "encoder layer 0" in text, text
    status, text = post(front.url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and json.loads(text)["error"]["code"] == "adapter_not_found", text

    status, text = post(front.url, "/v1/load_lora_adapter", {"lora_name": "chat_again", "lora_path": "chat_again",
                                                             "description": "chat, once more"})
    assert status == 200, text
    status, text = post(front.url, "/v1/load_lora_adapter", {"lora_name": "chat_again", "lora_path": "chat_again"})
    assert status == 400 and "already loaded" in text
    cards = {card.id: card for card in client.models.list().data}
    assert cards["chat_again"].parent == "mol2"
    again = chat(client, "chat_again", max_tokens=12, extra_body={"ignore_eos": True})
    assert again.model == "chat_again"
    assert again.choices[0].message.content == chat(client, "chat", max_tokens=12,
                                                    extra_body={"ignore_eos": True}).choices[0].message.content
    # the engine's router now scores the new set (its option cache is per set)
    status, text = post(f"http://{server.http_url}", "/v2/models/mol2/generate",
                        {"text_input": "route me", "max_tokens": 1, "end_conversation": True})
    assert status == 200 and set(json.loads(json.loads(text)["route_scores"])) == {"chat", "coding", "chat_again"}

    status, text = post(front.url, "/v1/unload_lora_adapter", {"lora_name": "chat_again"})
    assert status == 200, text
    with pytest.raises(openai.NotFoundError):
        chat(client, "chat_again")
    assert "chat_again" not in {card.id for card in client.models.list().data}


# -- the prefix cache across adapters ----------------------------------------------------------------------------

def metric(front, name: str, **labels) -> float:
    """The value of one series of the front end's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"{front.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    want = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and line.split("{", 1)[1].split("}", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_history_under_another_adapter_comes_from_the_cache_with_the_stateful_tokens(front, client, server):
    text = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 8 + "Who naps?"
    history = [{"role": "user", "content": text}]
    hits_before = metric(front, "vllm:prefix_cache_hits_total", lora_name="coding", model_name="mol2")
    cold = chat(client, "chat", history, max_tokens=8, extra_body={"ignore_eos": True})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = chat(client, "coding", history, max_tokens=8, extra_body={"ignore_eos": True})
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens and cached >= warm.usage.prompt_tokens // 2
    assert metric(front, "vllm:prefix_cache_hits_total", lora_name="coding", model_name="mol2") - hits_before == cached
    status, answer = post(f"http://{server.http_url}", "/v2/models/mol2/generate",
                          {"text_input": text, "adapter": "coding", "max_tokens": 8, "ignore_eos": True,
                           "end_conversation": True})
    assert status == 200 and warm.choices[0].message.content == json.loads(answer)["text_output"]


def test_metrics_count_requests_and_tokens_per_adapter(front, client):
    before = {name: metric(front, name, lora_name="coding", model_name="mol2")
              for name in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count")}
    answer = chat(client, "coding", max_tokens=5, extra_body={"ignore_eos": True})
    assert metric(front, "vllm:generation_tokens_total", lora_name="coding", model_name="mol2") == \
        before["vllm:generation_tokens_total"] + answer.usage.completion_tokens
    assert metric(front, "vllm:time_to_first_token_seconds_count", lora_name="coding", model_name="mol2") == \
        before["vllm:time_to_first_token_seconds_count"] + 1
    assert metric(front, "vllm:request_success_total", finished_reason="length", lora_name="coding",
                  model_name="mol2") >= 1
    with urllib.request.urlopen(f"{front.url}/metrics", timeout=30) as response:
        assert 'vllm:lora_requests_info{max_lora="8",running_lora_adapters="",waiting_lora_adapters=""}' in \
            response.read().decode()


# -- without a server --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("deltas, stops, sent, stopped", [
    (["hello wor", "ld! more"], ["world"], "hello ", True),        # a stop split across deltas
    (["ab", "c", "d"], ["cx"], "abcd", False),                     # held back while it could start "cx", then sent
    (["one two three"], ["three", "two"], "one ", True),           # the earliest stop wins
    (["a\n", "\nb"], ["\n\n"], "a", True),
    (["plain text"], [], "plain text", False),
])
def test_stop_matcher(deltas, stops, sent, stopped):
    matcher, out, hit = StopMatcher(stops), [], False
    for delta in deltas:
        piece, hit = matcher.feed(delta)
        out.append(piece)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    assert "".join(out) == sent and hit == stopped
    assert not any(stop in "".join(out) for stop in stops)


def test_stop_matcher_holds_back_only_a_possible_start():
    matcher = StopMatcher(["END"])
    assert matcher.feed("abc E") == ("abc ", False)  # "E" might begin END
    assert matcher.feed("x") == ("Ex", False)  # it did not


def test_lora_requests_info_lists_running_and_waiting_adapters():
    metrics = Metrics(max_lora=4)
    metrics.waiting_for(1, "chat")
    metrics.waiting_for(2, "")  # routed: its adapter is not known yet
    metrics.waiting_for(3, "coding")
    metrics.first_token(3, "coding", 0.05)
    text = metrics.text().decode()
    assert 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="coding",waiting_lora_adapters="chat"}' in text
    for key in (1, 2, 3):
        metrics.done(key)
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in metrics.text().decode()
