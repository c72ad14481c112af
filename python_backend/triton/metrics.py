"""Counters on Triton's metrics endpoint (custom metrics of the Python backend), labelled by stage and adapter.

Families and metrics are created on first use and kept referenced for the model's lifetime: a family that is
garbage-collected disappears from the endpoint. Each stage counts what it did, so a routed turn that reaches
decode without its adapter shows up as written != applied.
"""

from __future__ import annotations

import threading

DESCRIPTIONS = {
    "mol2_routes_written": "adapter decisions written into a transfer (router stage)",
    "mol2_route_only_decisions": "adapter decisions returned to a client by the route model, nothing written",
    "mol2_routes_read": "adapter decisions read from a transfer (decode stage)",
    "mol2_routes_applied": "adapter decisions applied by a replay (decode stage)",
    "mol2_requests": "turns served",
    "mol2_replayed_tokens": "positions replayed through the decoder",
    "mol2_router_decision_ms_total": "time spent in router decisions, milliseconds, summed",
    "mol2_state_bytes_written": "bytes of conversation state written to the store (journal records)",
    "mol2_state_bytes_moved": "bytes of conversation state copied between processes or read back from the store",
    "mol2_transfer_bytes_total": "bytes of conversation state sent between a disaggregated pair's servers, by "
                                 "direction (to_decode, to_prefill) and kind (delta, full)",
    "mol2_transfer_fallbacks_total": "delta transfers not possible for a turn, which went whole instead, by reason",
    "mol2_link_tokens_total": "streamed tokens a decode server sent on relays' token links (several turns' a "
                              "message; the rest went on each turn's own stream)",
}


class Counters:
    def __init__(self, pb, stage: str):
        self.pb, self.stage = pb, stage
        self._families, self._metrics = {}, {}
        self._lock = threading.Lock()

    def add(self, name: str, adapter: str, value: float = 1.0) -> None:
        self.count(name, value, adapter=adapter)

    def count(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add `value` to the counter `name` with these labels (besides `stage`). The relay counts from its turns'
        threads, so every call to the backend's metrics holds the lock: two threads incrementing at once crashed
        tritonserver itself (a SIGSEGV in the Python backend's Metric::LoadFromSharedMemory, 16 relayed streams)."""
        key = (name, *sorted(labels.items()))
        with self._lock:
            if name not in self._families:
                self._families[name] = self.pb.MetricFamily(name=name, description=DESCRIPTIONS[name],
                                                            kind=self.pb.MetricFamily.COUNTER)
            if key not in self._metrics:
                self._metrics[key] = self._families[name].Metric(labels={"stage": self.stage, **labels})
            self._metrics[key].increment(value)

    def close(self) -> None:
        """Drop the metrics while the model's process can still tell Triton (from `finalize`). One freed later, as
        the interpreter exits, finds the process's shared memory gone and crashes it: a segfault at every stop."""
        with self._lock:
            self._metrics.clear()
            self._families.clear()
