"""Structured output on the OpenAI port: a request's `response_format`, vLLM's `guided_*` extras and
`structured_outputs`, and a forced tool call (tools.py), turned into the one grammar the engine applies
(python_backend/core/structured.py's GrammarSpec, the `engine` model's `structured_output` input).

At most one of them may constrain an answer; a second is a 400 naming it. Each is checked here by building its
grammar (no tokenizer needed), so a malformed schema, regex or grammar is a 400 naming its field before the engine
sees the request. `json_schema` is enforced whether or not it says `strict`.
"""

from __future__ import annotations

import json

from ...core.structured import GrammarSpec
from .schema import APIError


def grammar_of(body, forced_call: GrammarSpec | None = None) -> GrammarSpec | None:
    """The grammar `body` asks for (None: free text), checked. `forced_call`: tool_choice's (tools.py)."""
    asked = [(field, spec) for field, spec in _asked(body) if spec is not None]
    if forced_call is not None:
        asked.append(("tool_choice", forced_call))
    if len(asked) > 1:
        fields = ", ".join(field for field, _ in asked)
        raise APIError(400, f"{asked[1][0]}: only one constraint on the answer may be given, got {fields}",
                       asked[1][0], "invalid_value")
    if not asked:
        return None
    field, spec = asked[0]
    try:
        return spec.check()
    except ValueError as error:
        raise APIError(400, f"{field}: {error}", field, "invalid_value") from None


def _asked(body):
    """(field, GrammarSpec or None) for each way a request may constrain its answer."""
    form = body.response_format
    if form is not None and form.type == "json_object":
        yield "response_format", GrammarSpec("json_object")
    if form is not None and form.type == "json_schema":
        if form.json_schema is None:
            raise APIError(400, "response_format.json_schema is required when type is json_schema",
                           "response_format.json_schema", "invalid_value")
        yield "response_format.json_schema.schema", GrammarSpec("json_schema", json.dumps(form.json_schema.schema_))
    yield "guided_json", _schema(body.guided_json, "guided_json")
    yield "guided_regex", None if body.guided_regex is None else GrammarSpec("regex", body.guided_regex)
    yield "guided_choice", None if body.guided_choice is None else GrammarSpec("choice", json.dumps(body.guided_choice))
    yield "guided_grammar", None if body.guided_grammar is None else GrammarSpec("grammar", body.guided_grammar)
    outputs = body.structured_outputs
    if outputs is not None:
        given = [(name, value) for name, value in (("json", outputs.json_), ("regex", outputs.regex),
                                                   ("choice", outputs.choice), ("grammar", outputs.grammar),
                                                   ("json_object", outputs.json_object or None))
                 if value is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
                           "structured_outputs", "invalid_value")
        (name, value), = given
        field = f"structured_outputs.{name}"
        if name == "json":
            yield field, _schema(value, field)
        elif name == "choice":
            yield field, GrammarSpec("choice", json.dumps(value))
        elif name == "json_object":
            yield field, GrammarSpec("json_object")
        else:
            yield field, GrammarSpec(name, value)


def _schema(value: dict | str | None, field: str) -> GrammarSpec | None:
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise APIError(400, f"{field}: not valid JSON: {error}", field, "invalid_value") from None
    return GrammarSpec("json_schema", json.dumps(value))
