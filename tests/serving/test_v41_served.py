"""The deepseek_v41 family served by the real Triton server: a model in the release's format (native names,
sharded safetensors) and PEFT adapters on its native module names, driven over HTTP `generate` as the ced family
is. A conversation that switches adapters every turn answers the family's reference serial path token for token
(ced/deepseek_v41/conversation.py), each turn replaying W positions; it is stored in the journal and goes on after
the server restarts; the OpenAI API in front of it answers as the reference, sharing a prompt's prefix across
adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from openai import OpenAI

from ced.adapters import write_peft_adapter
from ced.deepseek_v41.adapters import V41AdapterSet
from ced.deepseek_v41.checkpoint import load_checkpoint, write_checkpoint
from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.conversation import V41Conversation
from ced.deepseek_v41.model import DeepseekV41ForCausalLM
from ced.engines import ensure_onnx_engine
from ced.tokenization import ChatTokenizer
from python_backend.core.seal import SECRET_VARIABLE, create_secret_file
from python_backend.core.settings import ROOT
from python_backend.server.openai_api import OpenAIServer, OpenAISettings
from python_backend.server.launcher import Ports, running

from test_triton import post

ADAPTERS = ("chat", "coding")
TURNS = [("hello there", "chat"), ("write a loop", "coding"), ("and now?", "base"), ("thanks", "chat")]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    """v41-tiny in the release's format, its tokenizer UTF-8 bytes, two adapters on the decoder's attention and
    shared expert (the placement rule's modules above layer E)."""
    root, config = tmp_path_factory.mktemp("v41_served"), V41Config.from_name("v41-tiny")
    model = DeepseekV41ForCausalLM.from_config(config, seed=0)
    write_checkpoint(root / "model", config, model.state_dict(), max_shard_bytes=1 << 20)
    modules, E = V41AdapterSet(model).modules, config.decoder_start
    entries = []
    for seed, name in enumerate(ADAPTERS, start=1):
        g = torch.Generator().manual_seed(seed)
        weights = {module: (torch.randn(4, m.in_features, generator=g) * 0.2,
                            torch.randn(m.out_features, 4, generator=g) * 0.2)
                   for module, m in modules.items() if int(module.split(".")[1]) > E and ".experts." not in module}
        write_peft_adapter(root / "adapters" / name, weights, r=4, lora_alpha=8, base_model="v41-tiny")
        entries.append({"name": name, "path": f"adapters/{name}", "description": f"the {name} adapter"})
    (root / "adapter_set.json").write_text(json.dumps({"adapters": entries}))
    return root


def reference_turns(v41_dir, turns, prompts=None) -> list[list[int]]:
    """The family's serial reference: prefill the turn, replay W under its adapter, greedy steps. `prompts`: each
    turn's tokens as given (a fresh conversation each), else the chat template's user turns of one conversation."""
    _, model = load_checkpoint(v41_dir / "model")
    adapters = V41AdapterSet(model)
    for name in ADAPTERS:
        adapters.load(name, v41_dir / "adapters" / name)
    tokenizer, conversation, answers = ChatTokenizer(v41_dir / "model"), V41Conversation(model), []
    for number, (text, adapter) in enumerate(turns):
        adapter = None if adapter == "base" else adapter
        if prompts is not None:
            conversation = V41Conversation(model)
            conversation.prefill(prompts[number])
        else:
            conversation.prefill(tokenizer.user_turn(tokenizer.encode(text), first=conversation.length == 0))
        adapters.use(adapter)
        logits, ids = conversation.replay(adapter), []
        for _ in range(MAX_TOKENS):
            ids.append(int(logits.argmax()))
            logits = conversation.step(ids[-1], adapter)
        answers.append(ids)
    return answers


@pytest.fixture(scope="module")
def v41_server(v41_dir):
    repository = v41_dir / "model_repository"
    shutil.copytree(ROOT / "model_repository", repository)

    def start(store: str = "store", engine: str = "torch"):
        env = {"MOL2_ENGINE": engine, "MOL2_MODEL_DIR": str(v41_dir / "model"),
               "MOL2_ADAPTER_SET": str(v41_dir / "adapter_set.json"), "MOL2_STORE_DIR": str(v41_dir / store),
               SECRET_VARIABLE: str(create_secret_file(v41_dir / "server.secret"))}
        return running(repository, Ports.free(), v41_dir / "triton", v41_dir / "tritonserver.log", env=env)
    return start


def converse(ports, tokenizer, turns) -> tuple[list[str], str]:
    """One conversation's turns over HTTP generate, each under its adapter and replaying W whatever the switch:
    the answers' texts and the conversation's id."""
    answers, conversation, context = [], None, 0
    window = V41Config.from_name("v41-tiny").sliding_window
    for text, adapter in turns:
        fields = dict(text_input=text, adapter=adapter, max_tokens=MAX_TOKENS, ignore_eos=True)
        if conversation:
            fields["conversation_id"] = conversation
        answer = post(ports, "/v2/models/mol2/generate", fields)
        assert "error" not in answer, answer
        assert answer["applied_adapter"] == adapter
        context += len(tokenizer.user_turn(tokenizer.encode(text), first=context == 0))
        assert answer["replayed_tokens"] == min(window, context)
        context += MAX_TOKENS
        conversation = answer["conversation_id_out"]
        answers.append(answer["text_output"])
    return answers, conversation


def test_a_v41_conversation_switching_adapters_is_the_reference_and_survives_a_restart(v41_dir, v41_server):
    tokenizer, expected = ChatTokenizer(v41_dir / "model"), reference_turns(v41_dir, TURNS)
    with v41_server() as ports:
        answers, conversation = converse(ports, tokenizer, TURNS[:3])
        check_the_openai_api(v41_dir, ports, tokenizer)
        check_a_hot_adapter_update(v41_dir, ports)
    with v41_server() as ports:  # a new server process: the conversation comes back from the journal
        text, adapter = TURNS[3]
        fields = dict(text_input=text, adapter=adapter, conversation_id=conversation, max_tokens=MAX_TOKENS,
                      ignore_eos=True)
        answer = post(ports, "/v2/models/mol2/generate", fields)
        assert "error" not in answer, answer
        answers.append(answer["text_output"])
    assert answers == [tokenizer.decode(ids) for ids in expected]


def test_a_v41_conversation_on_onnxruntime_is_the_reference(v41_dir, v41_server):
    """`--engine onnxruntime`: the same Triton models on the family's exported graphs (exported once, as `mol2 serve`
    does before starting) answer a conversation that switches adapters as the reference serial path does."""
    ensure_onnx_engine(v41_dir / "model")
    tokenizer, expected = ChatTokenizer(v41_dir / "model"), reference_turns(v41_dir, TURNS[:3])
    with v41_server(store="ort-store", engine="onnxruntime") as ports:
        answers, _ = converse(ports, tokenizer, TURNS[:3])
    assert "with OrtV41Engine (--engine onnxruntime)" in (v41_dir / "tritonserver.log").read_text()
    assert answers == [tokenizer.decode(ids) for ids in expected]


def check_the_openai_api(v41_dir, ports, tokenizer) -> None:
    """The OpenAI API in front of the same server, with the official client: a chat sent whole under one adapter,
    then under another, answers as the reference does, the second from the first's prefix in the cache (one
    history whatever adapter reads it)."""
    front = OpenAIServer(OpenAISettings(ports.grpc_url, v41_dir / "model", v41_dir / "adapter_set.json"),
                         port=0).start()
    try:
        client = OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "a question long enough to fill a window or two. " * 3}]
        prompt, _ = tokenizer.render(messages)
        answers = [client.chat.completions.create(model=adapter, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0.0) for adapter in ("chat", "coding")]
        expected = reference_turns(v41_dir, [("", "chat"), ("", "coding")], prompts=[prompt, prompt])
        assert [a.choices[0].message.content for a in answers] == [tokenizer.decode(ids) for ids in expected]
        assert [a.model for a in answers] == ["chat", "coding"]
        assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens == len(prompt)
        assert answers[1].usage.prompt_tokens_details.cached_tokens == len(prompt)  # shared across adapters
    finally:
        front.stop()


def check_a_hot_adapter_update(v41_dir, ports) -> None:
    """Pointing `chat` at another adapter's directory takes effect on the next turn, without a restart: a
    conversation whose windows were built under the old `chat` replays under the new one and answers as `coding`."""
    set_file = v41_dir / "adapter_set.json"
    original = set_file.read_text()

    def turn(text, adapter, conversation=None):
        fields = dict(text_input=text, adapter=adapter, max_tokens=MAX_TOKENS, ignore_eos=True)
        if conversation:
            fields["conversation_id"] = conversation
        answer = post(ports, "/v2/models/mol2/generate", fields)
        assert "error" not in answer, answer
        return answer

    starts = [turn("the same start", "chat") for _ in range(3)]
    a, b, c = (start["conversation_id_out"] for start in starts)
    before = turn("again", "chat", b)["text_output"]
    try:
        updated = json.loads(original)
        shutil.copytree(v41_dir / "adapters" / "coding", v41_dir / "adapters" / "coding_copy", dirs_exist_ok=True)
        updated["adapters"][0]["path"] = "adapters/coding_copy"  # "chat" now serves the coding adapter's weights
        set_file.write_text(json.dumps(updated))
        after = turn("again", "chat", a)
        assert after["text_output"] == turn("again", "coding", c)["text_output"] != before
    finally:
        set_file.write_text(original)
    assert turn("the same start", "chat")["text_output"] == starts[0]["text_output"]  # rolled back
