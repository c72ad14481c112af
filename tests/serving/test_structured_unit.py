"""Structured output and logprobs without a server: each grammar kind builds or is refused with its reason, one spec
compiles once for many rows, the scheduler's grammar rows answer what their grammar allows and end when it is
complete while the rows beside them get the tokens they get alone, and logprobs come from the drawn distribution."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import torch

from ced import CEDEngine, CEDForCausalLM
from ced.batched import BatchedEngine
from ced.engine import SamplingParams, sample, sample_with_logprobs
from ced.tokenization import ChatTokenizer
from python_backend.core.inputs import RequestError, generation
from python_backend.core.routing import RouteDecision
from python_backend.core.scheduler import Scheduler, Turn
from python_backend.core.store import ConversationStore
from python_backend.core.structured import GrammarSpec, Grammars

from turn_sink import ListSink

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                         "pet": {"enum": ["cat", "dog"]}}}


@pytest.mark.parametrize("spec", [GrammarSpec("json_schema", json.dumps(PERSON)), GrammarSpec("json_object"),
                                  GrammarSpec("regex", "[a-z]{2,4}"), GrammarSpec("choice", '["yes", "no"]'),
                                  GrammarSpec("grammar", 'root ::= "a" ("b" | "c")'),
                                  GrammarSpec("tool_call", json.dumps(PERSON))])
def test_each_kind_builds_and_round_trips(spec):
    assert GrammarSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("kind, value, reason", [
    ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
    ("json_schema", "{", "not valid JSON"),
    ("json_schema", "[1]", "must be a JSON object"),
    ("regex", "a(b", "parenthesis is not closed"),
    ("grammar", "root ::= ", "EBNF parser error"),
    ("choice", "[]", "non-empty list"),
    ("tool_call", '{"type": 5}', "Type should be a string"),
])
def test_a_malformed_grammar_is_refused_with_its_reason(kind, value, reason):
    with pytest.raises(ValueError, match=reason):
        GrammarSpec(kind, value).check()


def test_the_engine_input_is_checked_where_it_arrives():
    """inputs.generation: the one place a request's sampling (and now its grammar and logprobs) is read."""
    def get(inputs):
        return lambda name, kind, default: kind(inputs[name]) if name in inputs else default

    spec = GrammarSpec("regex", "[0-9]+").to_json().encode()
    _, sampling = generation(get({"structured_output": spec, "logprobs": 3}))
    assert json.loads(sampling.grammar)["type"] == "regex" and sampling.logprobs == 3
    with pytest.raises(RequestError, match="regex: Regex parsing error"):
        generation(get({"structured_output": GrammarSpec("regex", "a(").to_json().encode()}))
    with pytest.raises(RequestError, match="logprobs must be between 0 and 20"):
        generation(get({"logprobs": 21}))


def test_one_spec_compiles_once_for_many_rows():
    grammars = Grammars(ChatTokenizer("no-tokenizer-here"), 320)
    spec = GrammarSpec("json_schema", json.dumps(PERSON)).to_json()
    matchers = [grammars.matcher(spec) for _ in range(16)]
    assert grammars.compiles == 1 and len({id(m) for m in matchers}) == 16  # one compiled grammar, 16 matchers
    grammars.matcher(GrammarSpec("json_object").to_json())
    assert grammars.compiles == 2


def test_json_rows_never_write_control_characters():
    """xgrammar's maxLength string lets raw control characters through; JSON does not: the JSON mask removes them."""
    grammars = Grammars(ChatTokenizer("no-tokenizer-here"), 320)
    row = grammars.matcher(GrammarSpec("json_schema", json.dumps(PERSON)).to_json())
    for token in b'{"name": "':
        row.accept(token)
    logits = torch.zeros(320)
    logits[0x16] = 10.0  # the likeliest, and not JSON inside a string
    masked = row.mask(logits)
    assert masked[0x16] == -math.inf and masked[ord("a")] == 0.0 and masked[300] == -math.inf  # 300 prints nothing


def test_a_json_row_closes_before_its_budget_ends():
    """A model that would write "a" forever: with CLOSING_RESERVE tokens left the row closes its string, writes the
    required key the schema still needs and closes the object, all within max_tokens."""
    grammars = Grammars(ChatTokenizer("no-tokenizer-here"), 320)
    schema = {"type": "object", "required": ["text", "count"],
              "properties": {"text": {"type": "string"}, "count": {"type": "integer"}}}
    row = grammars.matcher(GrammarSpec("json_schema", json.dumps(schema)).to_json())
    logits = torch.zeros(320)
    logits[ord("a")], logits[ord("7")] = 5.0, 4.0
    out = []
    for left in range(64, 0, -1):
        token = int(row.mask(logits, left).argmax())
        assert row.greedy(logits, left) == token  # the allowed tokens' argmax, no masked copy: the same pick
        row.accept(token)
        out.append(token)
        if row.done:
            break
    answer = json.loads(bytes(out))
    jsonschema.validate(answer, schema)
    assert answer["text"].startswith("a" * 20) and len(out) <= 64 and row.done
    unguarded = grammars.matcher(GrammarSpec("json_schema", json.dumps(schema)).to_json())
    for _ in range(64):
        unguarded.accept(int(unguarded.mask(logits).argmax()))  # no budget given: the model's "a" forever
    assert not unguarded.done


@pytest.fixture()
def scheduler(served_dir, tmp_path):
    engine = CEDEngine(CEDForCausalLM.from_pretrained(served_dir / "model"))
    for name in ("chat", "coding"):
        engine.adapters.load(name, served_dir / "adapters" / name)
    tokenizer = ChatTokenizer(served_dir / "model")
    return Scheduler(BatchedEngine(engine), ConversationStore(tmp_path, engine.config), tokenizer,
                     lambda decision: decision.adapter, lambda: []), tokenizer


def stateless(prompt, adapter, sink, sampling=SamplingParams(), max_tokens=96):
    decision = RouteDecision(adapter, 0)
    return Turn("", [], lambda pooled: decision, sink, max_tokens=max_tokens, sampling=sampling, explicit=True,
                prompt=prompt)


def test_grammar_rows_follow_their_grammar_and_the_rows_beside_them_are_untouched(scheduler):
    scheduler, tokenizer = scheduler
    prompts = [tokenizer.encode(f"row {n} says") for n in range(4)]
    alone = []
    for n in (1, 3):
        sink = ListSink()
        scheduler.submit(stateless(prompts[n], "chat", sink))
        scheduler.drain()
        alone.append(sink.tokens)
    schema = SamplingParams(grammar=GrammarSpec("json_schema", json.dumps(PERSON)).to_json())
    choice = SamplingParams(grammar=GrammarSpec("choice", '["alpha", "beta"]').to_json())
    sinks, turns = [ListSink() for _ in range(4)], []
    for n, sampling in enumerate([schema, SamplingParams(), choice, SamplingParams()]):
        turns.append(stateless(prompts[n], "chat" if n % 2 else "coding", sinks[n], sampling))
        scheduler.submit(turns[-1])
    scheduler.drain()
    assert all(sink.done and sink.error is None for sink in sinks)
    answer = json.loads(tokenizer.decode(sinks[0].tokens))
    jsonschema.validate(answer, PERSON)
    assert tokenizer.decode(sinks[2].tokens) in ("alpha", "beta")
    assert turns[0].finish_reason == turns[2].finish_reason == "stop"  # complete: ended without a stop token
    assert [sinks[1].tokens, sinks[3].tokens] == alone  # the plain rows of the mixed batch: as alone
    assert scheduler.grammars.compiles == 2


def test_a_grammar_row_with_logprobs_reports_the_masked_distribution(scheduler):
    scheduler, tokenizer = scheduler
    sink = ListSink()
    turn = stateless(tokenizer.encode("pick"), "chat", sink,
                     SamplingParams(temperature=1.0, seed=3, logprobs=4,
                                    grammar=GrammarSpec("choice", '["ab", "ba"]').to_json()))
    scheduler.submit(turn)
    scheduler.drain()
    assert tokenizer.decode(sink.tokens) in ("ab", "ba") and len(turn.logprobs) == len(sink.tokens) == 2
    first = turn.logprobs[0]
    allowed = [(token, lp) for token, lp in first.top if lp > -math.inf]
    assert sorted(token for token, _ in allowed) == [ord("a"), ord("b")]  # the grammar's two choices, nothing else
    assert math.isclose(sum(math.exp(lp) for _, lp in allowed), 1.0, rel_tol=1e-5)
    assert turn.logprobs[1].logprob == pytest.approx(0.0, abs=1e-6)  # the second letter is forced


def test_logprobs_come_from_the_distribution_the_token_is_drawn_from():
    logits = torch.tensor([2.0, 1.5, 1.0, -1.0, 0.5])
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_k=3, seed=1),
                     SamplingParams(temperature=1.3, top_p=0.8, presence_penalty=1.0)):
        for seed in range(20):
            drawn = sample(logits, sampling, torch.Generator().manual_seed(seed), generated=[0])
            token, logprobs = sample_with_logprobs(logits, sampling, 5, torch.Generator().manual_seed(seed),
                                                   generated=[0])
            assert token == drawn  # the same draw: asking for logprobs never changes the answer
            assert logprobs.top[0][1] >= logprobs.logprob and dict(logprobs.top)[token] == logprobs.logprob
            assert math.isclose(sum(math.exp(lp) for _, lp in logprobs.top), 1.0, rel_tol=1e-5)
    _, filtered = sample_with_logprobs(logits, SamplingParams(temperature=1.0, top_k=2), 5,
                                       torch.Generator().manual_seed(0))
    assert [lp == -math.inf for _, lp in filtered.top] == [False, False, True, True, True]  # top-k's cut: -inf
    _, greedy = sample_with_logprobs(logits, SamplingParams(), 1)
    assert greedy.top[0][0] == 0 and greedy.logprob == pytest.approx(float(logits.log_softmax(-1)[0]))
