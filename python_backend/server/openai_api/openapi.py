"""What /openapi.json declares: each endpoint's request body (the models of schema.py) and its error responses in
OpenAI's shape. The handlers read their bodies raw (so every mistake is a 400 of OpenAI's shape, never FastAPI's
422): the bodies are declared here rather than by typed handler parameters. A server with API keys declares the
bearer scheme, required everywhere but its open paths, and the 401 of each endpoint; one without declares neither."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_SCHEMAS = "#/components/schemas/"


class ErrorObject(BaseModel):
    message: str
    type: str  # invalid_request_error (4xx) or server_error (5xx)
    param: str | None  # the field at fault, e.g. "messages[0].content"
    code: str | None  # e.g. invalid_value, model_not_found, request_too_large, engine_unavailable


class ErrorResponse(BaseModel):
    error: ErrorObject


_WHEN = {
    400: "a malformed body, a field of the wrong type or out of range (`param` names it), a field this server "
         "cannot honour, JSON nested deeper than max_json_depth, a prompt over max_prompt_tokens, or what the engine "
         "refuses",
    401: "no API key, or not one of this server's (`Authorization: Bearer KEY`); answered with `WWW-Authenticate: "
         "Bearer`",
    404: "no such model (or adapter)",
    413: "a body over max_body_bytes",
    500: "a failure of the server or the engine (logged with its cause)",
    503: "the engine cannot be reached or is not loaded; retry shortly",
    507: "the server's disk (or quota) is full: nothing could be stored; retry once there is room",
}


def errors(*statuses: int) -> dict:
    """A route's `responses=` for these error statuses."""
    return {status: {"model": ErrorResponse, "description": _WHEN[status]} for status in statuses}


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra=` declaring `model` as its JSON body (added to the components by `install`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": _SCHEMAS + model.__name__}}}}}


def install(app: FastAPI, bodies: list[type[BaseModel]], bearer: bool = False,
            open_paths: tuple[str, ...] = ()) -> None:
    """app.openapi builds the document once, with `bodies` (and the models they use) among its schemas; with
    `bearer`, the key every path but `open_paths` requires."""

    def document() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in bodies:
                definition = model.model_json_schema(ref_template=_SCHEMAS + "{model}")
                components.update(definition.pop("$defs", {}))
                components[model.__name__] = definition
            if bearer:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
                for path in open_paths:
                    for operation in schema["paths"].get(path, {}).values():
                        operation["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document
