"""The front end's own Prometheus metrics (GET /metrics), under vLLM's names where they mean the same, so that
dashboards and gateways built for vLLM read them; every per-request series carries `lora_name` (the adapter that
answered: an adapter name, or "mol2" for the base model) and `model_name` (the served model, "mol2").

Token counts come from the engine's own outputs (`prompt_tokens`, `cached_tokens`, `output_tokens`,
`replayed_tokens`), so the prefix-cache counters count what the engine reused, not an estimate.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

SERVED = "mol2"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ("model_name", "lora_name")

# name -> help text; docs/openai_api.md's metrics table is this list
DESCRIPTIONS = {
    "vllm:request_success_total": "requests finished, by finished_reason (stop, length)",
    "mol2_openai_request_errors_total": "requests refused or failed, by HTTP status",
    "vllm:prompt_tokens_total": "prompt tokens of finished requests (the rendered history, as the engine counts it)",
    "vllm:generation_tokens_total": "tokens generated",
    "vllm:time_to_first_token_seconds": "seconds from the request's arrival to its first token",
    "vllm:prefix_cache_queries_total": "prompt tokens looked up in the engine's prefix cache",
    "vllm:prefix_cache_hits_total": "prompt tokens found in the prefix cache (reused, whichever adapter wrote them)",
    "mol2_replayed_tokens_total": "positions replayed under the answering adapter (bounded by the window W)",
    "vllm:lora_requests_info": "running / waiting requests' adapters (value: the time of the last change)",
}


class Metrics:
    def __init__(self, max_lora: int):
        self.registry = CollectorRegistry()
        self.max_lora = max_lora

        def counter(name: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name.removesuffix("_total"), DESCRIPTIONS[name], LABELS + extra, registry=self.registry)

        self.success = counter("vllm:request_success_total", ("finished_reason",))
        self.errors = counter("mol2_openai_request_errors_total", ("status",))
        self.prompt_tokens = counter("vllm:prompt_tokens_total")
        self.generation_tokens = counter("vllm:generation_tokens_total")
        self.cache_queries = counter("vllm:prefix_cache_queries_total")
        self.cache_hits = counter("vllm:prefix_cache_hits_total")
        self.replayed = counter("mol2_replayed_tokens_total")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", DESCRIPTIONS["vllm:time_to_first_token_seconds"],
                              LABELS, buckets=TTFT_BUCKETS, registry=self.registry)
        self.waiting: dict[int, str] = {}  # request key -> the adapter asked for ("" when routed: not known yet)
        self.running: dict[int, str] = {}  # request key -> the adapter answering
        self.changed = time.time()
        self.registry.register(_LoraInfo(self))

    # -- one request's life ---------------------------------------------------------------------------------------

    def waiting_for(self, key: int, adapter: str) -> None:
        self.waiting[key] = adapter
        self.changed = time.time()

    def first_token(self, key: int, lora_name: str, seconds: float) -> None:
        self.waiting.pop(key, None)
        self.running[key] = lora_name
        self.changed = time.time()
        self.ttft.labels(SERVED, lora_name).observe(seconds)

    def done(self, key: int) -> None:
        if self.waiting.pop(key, None) is not None or self.running.pop(key, None) is not None:
            self.changed = time.time()

    def finished(self, lora_name: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int, replayed: int) -> None:
        self.success.labels(SERVED, lora_name, finish_reason).inc()
        self.prompt_tokens.labels(SERVED, lora_name).inc(prompt_tokens)
        self.generation_tokens.labels(SERVED, lora_name).inc(completion_tokens)
        self.cache_queries.labels(SERVED, lora_name).inc(prompt_tokens)
        self.cache_hits.labels(SERVED, lora_name).inc(cached_tokens)
        self.replayed.labels(SERVED, lora_name).inc(replayed)

    def failed(self, lora_name: str, status: int) -> None:
        self.errors.labels(SERVED, lora_name, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _LoraInfo:
    """vLLM's `vllm:lora_requests_info`: one sample whose labels list the adapters of running and waiting requests
    (comma-separated, the base model left out as vLLM does) and the adapter slots (`max_lora`); gateways that pick
    a replica by its resident adapters scrape this name. Built at scrape time, so the labels are never stale."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        metrics = self.metrics
        family = GaugeMetricFamily("vllm:lora_requests_info", DESCRIPTIONS["vllm:lora_requests_info"],
                                   labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        names = lambda values: ",".join(sorted({v for v in values if v and v != SERVED}))  # noqa: E731
        family.add_metric([names(metrics.running.values()), names(metrics.waiting.values()), str(metrics.max_lora)],
                          metrics.changed)
        yield family
