"""OpenAI-compatible endpoints in front of the Triton `engine` model (`mol2 serve --openai-port`).

    POST /v1/chat/completions, POST /v1/completions   (server-sent events with "stream": true; n choices)
    POST /v1/responses, GET / DELETE /v1/responses/{id} (OpenAI's Responses API; a chain is an engine conversation)
    GET  /v1/models                                     (mol2, auto, and each adapter of the set, parent "mol2")
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter (the adapter-set file, confined to an adapters root)
    GET  /metrics                                       (Prometheus text: per-adapter counters, vLLM's names)

`model` names the adapter: an adapter of the set, `mol2` (the base model), `auto` (routed by MoL2 inside the engine)
or `mol2:ADAPTER`. Triton stays the engine: every request is one gRPC stream to `engine`, which renders the messages
with the model's chat template and serves them through its prefix cache (on a disaggregated prefill server, to the
`mol2` relay, which renders them alike and decodes on the decode server: OpenAISettings.engine_model).
"""

from .app import OpenAISettings, create_app
from .server import OpenAIServer

__all__ = ["OpenAISettings", "OpenAIServer", "create_app"]
