"""The `engine` Triton model's stub side: one decoupled model that runs a whole turn (prefill -> route -> replay ->
decode) in its engine core, a process of its own (python_backend/core/engine_core.py says why and what they exchange).

Here, in Triton's model process: `execute` hands each request's input arrays to the core and returns at once; a
thread, the responder, turns the core's events into responses, counts the core's metrics, and asks Triton every
CANCEL_CHECK_S whether each client is still there, telling the core when one left. A core that dies fails its
turns (nothing of them stored: the journal holds each conversation's last good turn) and is started again
(tests/serving/test_engine_core.py kills one mid-turn).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import Pipe
from pathlib import Path

import numpy as np

from ced.tokenization import ChatTokenizer

from ..core.detokenize import text_delta, window
from ..core.events import Count, Event, Failed, Final, Token
from ..core.server_errors import ENGINE_FAILED
from .metrics import Counters
from .triton_io import CANCEL_CHECK_S, error_response, requested_outputs

CORE_START_TIMEOUT_S = 600.0
PYTHON_VARIABLE = "MOL2_PYTHON"  # the interpreter the core runs on (python_backend/server/launcher.py sets it)

INT_OUTPUTS = frozenset({"replayed_tokens", "prompt_tokens", "cached_tokens", "output_tokens"})


class CoreFailed(RuntimeError):
    pass


@dataclass
class Pending:
    """A request the core is serving: where its responses go, and what they carry so far."""

    sender: object
    wanted: frozenset[str]
    ids: list[int] = field(default_factory=list)  # the tokens streamed so far
    outputs: dict[str, np.ndarray] | None = None  # the turn's constant outputs, encoded once
    cancel_sent: bool = False


class EngineModel:
    def __init__(self, pb, parameters: dict[str, str]):
        self.pb, self.parameters = pb, parameters
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.counters = Counters(pb, "engine")
        self.pending: dict[int, Pending] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the pipe to the core, and `pending` while a core is replaced
        self._stopping = False
        self.core, self.to_core, self.from_core, model_dir = self._start_core()
        self.decode = ChatTokenizer(Path(model_dir)).decode
        # The responder never writes to the core: blocked on a full pipe to it, it would stop reading the core's
        # events, and a core blocked on a full pipe back stops reading requests (a cycle through `execute`).
        self._cancels: queue.SimpleQueue[int] = queue.SimpleQueue()
        threading.Thread(target=self._send_cancels, name="mol2-cancels", daemon=True).start()
        self._responder = threading.Thread(target=self._respond, name="mol2-responder", daemon=True)
        self._responder.start()

    # -- the core process ------------------------------------------------------------------------------------------

    def _start_core(self):
        """Start the core and wait until its engine is loaded; a core that cannot start fails the model's load."""
        to_core_read, to_core = Pipe(duplex=False)
        from_core, from_core_write = Pipe(duplex=False)
        python = os.environ.get(PYTHON_VARIABLE) or shutil.which("python3") or sys.executable
        fds = (to_core_read.fileno(), from_core_write.fileno())
        core = subprocess.Popen([python, "-m", "python_backend.core.engine_core", *map(str, fds)], pass_fds=fds)
        to_core_read.close()
        from_core_write.close()
        to_core.send(("init", self.parameters))
        deadline = time.monotonic() + CORE_START_TIMEOUT_S
        while not from_core.poll(1.0):
            if core.poll() is not None or time.monotonic() > deadline:
                core.kill()
                raise CoreFailed(f"the engine's core process exited with code {core.wait()} before it was ready")
        try:
            (kind, detail), = from_core.recv()
        except EOFError:
            raise CoreFailed(f"the engine's core process exited with code {core.wait()} before it was ready") from None
        if kind != "ready":
            core.wait()
            cause = detail.strip().splitlines()[-1] if detail.strip() else "no reason given"
            raise CoreFailed(f"the engine's core process could not start: {cause}\n{detail}")
        return core, to_core, from_core, detail

    def finalize(self) -> None:
        self._stopping = True
        with self._lock:
            try:
                self.to_core.send(("stop",))
            except OSError:
                pass
        self._responder.join(timeout=60)  # it sends what the core flushed before it stopped
        if self.core.poll() is None:
            self.core.kill()
        self.core.wait()
        self.counters.close()

    # -- requests ------------------------------------------------------------------------------------------------

    def execute(self, requests) -> None:
        batch = []
        with self._lock:
            for request in requests:
                request_id = next(self._ids)
                self.pending[request_id] = Pending(request.get_response_sender(), requested_outputs(request))
                inputs = {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}
                batch.append((request_id, inputs))
            try:
                self.to_core.send(("requests", batch))
            except OSError:  # the core died: the responder fails these with the others and starts a new one
                pass

    # -- responses (the responder's thread) -----------------------------------------------------------------------

    def _respond(self) -> None:
        next_check = time.monotonic() + CANCEL_CHECK_S
        while True:
            try:
                if self.from_core.poll(max(0.0, next_check - time.monotonic())):
                    for event in self.from_core.recv():
                        self._handle(event)
            except (EOFError, OSError):
                if self._stopping:
                    return
                self._replace_core()
            except Exception:  # noqa: BLE001 - a client gone mid-stream must not stop the others' responses
                self.pb.Logger.log_error(f"engine: a response could not be sent: {traceback.format_exc()}")
            if time.monotonic() >= next_check:
                self._check_cancelled()
                next_check = time.monotonic() + CANCEL_CHECK_S

    def _handle(self, event: Event) -> None:
        if isinstance(event, Token):
            pending = self.pending[event.request_id]
            if event.outputs is not None:
                pending.outputs = self._encode(event.outputs)
            pending.ids.append(event.token)
            self._send(pending, window(pending.ids, 1), 1, False, "", logprobs=event.logprobs)
        elif isinstance(event, Final):
            pending = self.pending.pop(event.request_id)  # forgotten first: no cancellation check follows its last
            if pending.outputs is None:
                pending.outputs = self._encode(event.outputs)
            if event.ids is None:  # streamed: the last response adds no ids, it flushes a character left unfinished
                self._send(pending, window(pending.ids, 0), 0, True, event.finish_reason, self.final, event.count)
            else:
                self._send(pending, event.ids, len(event.ids), True, event.finish_reason, self.final, event.count,
                           event.logprobs)
        elif isinstance(event, Failed):
            pending = self.pending.pop(event.request_id)
            if event.message is None:  # cancelled
                pending.sender.send(flags=self.final)
            else:
                pending.sender.send(error_response(self.pb, event.message, event.code), flags=self.final)
        elif isinstance(event, Count):
            self.counters.add(event.metric, event.adapter, event.value)

    def _send(self, pending: Pending, ids: list[int], fresh: int, last: bool, finish_reason: str, flags: int = 0,
              count: int | None = None, logprobs: list | None = None) -> None:
        """Only the outputs the request asked for are built (see triton_io.response). `logprobs`: the new tokens'
        [id, logprob, [[id, logprob], ...]] each, sent as JSON when the request asked for them."""
        wanted, pb = pending.wanted, self.pb
        outputs = {name: array for name, array in pending.outputs.items() if name in wanted}
        if "output_tokens" in wanted:
            outputs["output_tokens"] = np.array([len(pending.ids) if count is None else count], dtype=np.int32)
        if "finish_reason" in wanted:
            outputs["finish_reason"] = _text(finish_reason)
        if "text_output" in wanted:
            outputs["text_output"] = _text(text_delta(self.decode, ids, fresh, last))
        if logprobs and "logprobs" in wanted:
            outputs["logprobs"] = _text(json.dumps(logprobs))
        pending.sender.send(pb.InferenceResponse([pb.Tensor(name, array) for name, array in outputs.items()]),
                            flags=flags)

    @staticmethod
    def _encode(outputs: dict[str, object]) -> dict[str, np.ndarray]:
        return {name: np.array([value], dtype=np.int32) if name in INT_OUTPUTS else _text(value)
                for name, value in outputs.items()}

    def _check_cancelled(self) -> None:
        for request_id, pending in list(self.pending.items()):
            if pending.cancel_sent:
                continue
            try:
                cancelled = pending.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - no answer: asked again next time
                continue
            if cancelled:  # the core fails the turn at its next step; its empty last response comes back here
                pending.cancel_sent = True
                self._cancels.put(request_id)

    def _send_cancels(self) -> None:
        while True:
            request_id = self._cancels.get()
            with self._lock:
                try:
                    self.to_core.send(("cancel", request_id))
                except OSError:  # the core died: the responder fails the turn with the others
                    pass

    def _replace_core(self) -> None:
        """The core died: its turns fail (stored nothing), and a new core takes the requests that follow."""
        with self._lock:
            code = self.core.wait()
            self.pb.Logger.log_error(f"engine: the core process died (exit code {code}); starting a new one")
            message = f"{ENGINE_FAILED} its core process died (exit code {code}); the turn was not stored"
            for pending in self.pending.values():
                try:
                    pending.sender.send(error_response(self.pb, message, "INTERNAL"), flags=self.final)
                except Exception:  # noqa: BLE001 - a client already gone
                    pass
            self.pending.clear()
            try:
                self.core, self.to_core, self.from_core, _ = self._start_core()
            except CoreFailed as error:  # the old pipes stay closed: tried again on the responder's next turn
                self.pb.Logger.log_error(f"engine: {error}")
                time.sleep(1.0)


def _text(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=object)
