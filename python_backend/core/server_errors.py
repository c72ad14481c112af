"""How an error that is the server's condition, not the client's mistake, stays one after it crossed processes.

The engine sends a TritonError code with every error, but not every path keeps it: Triton's HTTP `generate`
answers any error a model sends with 400, and a gRPC stream carries the message alone. So the message of a server
condition starts with a marker (after the "in ensemble 'NAME', " that Triton puts in front), and whoever answers a
client (the HTTP guard, the OpenAI front end) gives it the status the marker says.
"""

from __future__ import annotations

import re

STORAGE_FULL = "storage full:"  # a full disk or quota: nothing could be stored (retry once there is room)
STATE_DAMAGED = "stored state damaged:"  # a conversation's journal failed its checks (store.StoreDamaged)
ENGINE_FAILED = "engine failed:"  # a failure of the engine's own (logged with its traceback)

# the HTTP status each marker stands for on Triton's port; the OpenAI API answers a full disk with 507
STATUS = {STORAGE_FULL: 503, STATE_DAMAGED: 500, ENGINE_FAILED: 500}
_ENSEMBLE = re.compile(r"^(?:in ensemble '[^']*', )+")


def server_condition(message: str) -> str | None:
    """The marker `message` starts with, once Triton's ensemble prefixes are taken off (None: not the server's)."""
    text = _ENSEMBLE.sub("", message, count=1)
    return next((marker for marker in STATUS if text.startswith(marker)), None)
