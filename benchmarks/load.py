"""The client side the serving benchmarks share: streaming clients for our server and for vLLM's OpenAI server,
N concurrent streams (one thread and one socket per request in flight), per-request records and their summaries.

Ours: POST /v2/models/mol2/generate_stream (server-sent events, `output_tokens` = tokens so far) and the
non-streamed /generate. vLLM: POST /v1/completions with "stream": true and continuous usage stats (each chunk
carries `completion_tokens`), "ignore_eos": true. Only the standard library (http.client): no extra dependency.

A record keeps the time of every generated token, so a summary can count exactly the tokens generated inside a
measurement window: tokens_per_s = tokens timed inside the window / the window's length; TTFT is over the
requests sent inside the window; ITL over the gaps between successive tokens of one request.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence


class ServerError(RuntimeError):
    """The server refused or failed a request (its own message)."""


@dataclass
class Record:
    """One request: when it was sent, when each of its tokens arrived (time.perf_counter seconds)."""

    engine: str = ""
    adapter: str = ""
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None
    tag: str = "short"
    stream: int = 0
    turn: int = 0
    conversation_id: str | None = None
    prompt_tokens: int | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return None if not self.token_times else self.token_times[0] - self.start

    @property
    def gaps(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    def add_tokens(self, count: int, now: float | None = None) -> None:
        """`count` new tokens arrived together: they share one arrival time (a gap of 0 between them)."""
        now = time.perf_counter() if now is None else now
        self.token_times.extend([now] * max(0, count))


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------------------------------------- HTTP

def _connection(base: str, timeout: float) -> http.client.HTTPConnection:
    host, _, port = base.removeprefix("http://").rstrip("/").partition(":")
    return http.client.HTTPConnection(host, int(port or 80), timeout=timeout)


def _error_text(payload: bytes) -> str:
    try:
        body = json.loads(payload)
    except ValueError:
        return payload.decode(errors="replace")[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):  # OpenAI style: {"error": {"message": ...}}
        error = error.get("message", error)
    return str(error)[:500]


def post_json(base: str, path: str, body: dict, timeout: float = 900.0) -> dict:
    connection = _connection(base, timeout)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ServerError(f"HTTP {response.status}: {_error_text(payload)}")
        answer = json.loads(payload)
        if isinstance(answer, dict) and "error" in answer:
            raise ServerError(_error_text(payload))
        return answer
    finally:
        connection.close()


def post_sse(base: str, path: str, body: dict, timeout: float = 900.0) -> Iterator[dict]:
    """The JSON of each `data:` line of a server-sent-event answer, up to `data: [DONE]` or the end."""
    connection = _connection(base, timeout)
    try:
        connection.request("POST", path, body=json.dumps(body),
                           headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = connection.getresponse()
        if response.status != 200:
            raise ServerError(f"HTTP {response.status}: {_error_text(response.read())}")
        while True:
            line = response.readline()
            if not line:
                return
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            event = json.loads(payload)
            if isinstance(event, dict) and "error" in event:
                raise ServerError(_error_text(payload))
            yield event
    finally:
        connection.close()


def get_text(base: str, path: str, timeout: float = 10.0) -> str:
    connection = _connection(base, timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ServerError(f"HTTP {response.status} on GET {path}")
        return payload.decode()
    finally:
        connection.close()


# -------------------------------------------------------------------------------------------------------- clients

class Mol2Client:
    """Our server's HTTP generate endpoints. `ignore_eos` is sent while the server takes it; the first answer
    that refuses it (an error naming ignore_eos) turns it off for every later request, and `ignore_eos_note` says
    so. (Today's server ignores a JSON field that names no input: then streams may stop early at a stop token, and
    the records' token counts show it.)"""

    def __init__(self, base: str, model: str = "mol2", ignore_eos: bool = True, timeout: float = 900.0):
        self.base, self.model, self.timeout = base, model, timeout
        self.ignore_eos = ignore_eos
        self.ignore_eos_note: str | None = None
        self._lock = threading.Lock()

    def _body(self, text, adapter, max_tokens, conversation_id, end_conversation, stream, min_tokens=None) -> dict:
        body = {"text_input": text, "max_tokens": max_tokens, "stream": stream}
        if min_tokens:
            body["min_tokens"] = min_tokens
        if adapter:
            body["adapter"] = adapter
        if conversation_id:
            body["conversation_id"] = conversation_id
        if end_conversation:
            body["end_conversation"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _refused_ignore_eos(self, error: Exception) -> bool:
        if self.ignore_eos and "ignore_eos" in str(error):
            with self._lock:
                self.ignore_eos = False
                self.ignore_eos_note = f"the server refused ignore_eos ({error}); sent without it"
            return True
        return False

    def stream(self, text: str, adapter: str | None, max_tokens: int, conversation_id: str | None = None,
               end_conversation: bool = False, record: Record | None = None, min_tokens: int | None = None) -> Record:
        """One streamed turn; `min_tokens` (no stop token before that many) is sent when given."""
        record = record or Record(engine="mol2", adapter=adapter or "")
        for attempt in range(2):
            record.start, record.token_times = time.perf_counter(), []
            try:
                seen = 0
                for event in post_sse(self.base, f"/v2/models/{self.model}/generate_stream",
                                      self._body(text, adapter, max_tokens, conversation_id, end_conversation, True,
                                                 min_tokens),
                                      self.timeout):
                    now = time.perf_counter()
                    count = int(event.get("output_tokens", seen))
                    record.add_tokens(count - seen, now)
                    seen = max(seen, count)
                    record.conversation_id = event.get("conversation_id_out", record.conversation_id)
                record.end = time.perf_counter()
                return record
            except ServerError as error:
                if attempt == 0 and self._refused_ignore_eos(error):
                    continue
                raise
        raise AssertionError("unreachable")

    def generate(self, text: str, adapter: str | None, max_tokens: int, conversation_id: str | None = None,
                 end_conversation: bool = False) -> tuple[dict, float]:
        """One non-streamed turn: (the answer's JSON, client-observed seconds)."""
        for attempt in range(2):
            started = time.perf_counter()
            try:
                answer = post_json(self.base, f"/v2/models/{self.model}/generate",
                                   self._body(text, adapter, max_tokens, conversation_id, end_conversation, False),
                                   self.timeout)
                return answer, time.perf_counter() - started
            except ServerError as error:
                if attempt == 0 and self._refused_ignore_eos(error):
                    continue
                raise
        raise AssertionError("unreachable")


class VllmClient:
    """vLLM's OpenAI completions: `model` is the LoRA name (a0..a3) or the base model's path."""

    def __init__(self, base: str, timeout: float = 900.0):
        self.base, self.timeout = base, timeout

    def stream(self, prompt: str, model: str, max_tokens: int, record: Record | None = None) -> Record:
        record = record or Record(engine="vllm", adapter=model)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0.0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        record.start, record.token_times = time.perf_counter(), []
        seen = 0
        for chunk in post_sse(self.base, "/v1/completions", body, self.timeout):
            now = time.perf_counter()
            usage = chunk.get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                record.prompt_tokens = usage["prompt_tokens"]
            if usage.get("completion_tokens") is not None:
                count = int(usage["completion_tokens"])
            elif chunk.get("choices"):
                count = seen + 1  # no usage in the chunk: one token a chunk
            else:
                count = seen
            record.add_tokens(count - seen, now)
            seen = max(seen, count)
        record.end = time.perf_counter()
        return record

    def complete(self, prompt: str, model: str, max_tokens: int) -> tuple[dict, float]:
        """One non-streamed completion: (the answer's JSON, client-observed seconds)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        started = time.perf_counter()
        answer = post_json(self.base, "/v1/completions", body, self.timeout)
        return answer, time.perf_counter() - started


def prometheus_sum(text: str, name: str) -> float | None:
    """The sum over labels of metric `name` (or `name_total`) in Prometheus text; None when absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in (name, f"{name}_total"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return total if found else None


# ----------------------------------------------------------------------------------------------------- the runner

@dataclass
class Run:
    records: list[Record]       # the steady streams' requests
    extras: list[Record]        # the extra requests (e.g. one long prompt)
    window: tuple[float, float]  # the measurement window (perf_counter seconds)
    wall_s: float               # start to the last request's end


Request = Callable[[int, int, Record], Record]  # (stream index, turn index, a blank record) -> the filled record


def run_streams(concurrency: int, request: Request, duration_s: float | None = None,
                requests_each: int | None = None, extras: Sequence[tuple[float, Callable[[Record], Record]]] = (),
                tail_s: float = 0.0) -> Run:
    """`concurrency` streams, each a thread sending one request after another: for `duration_s` (new requests start
    only inside the window; those in flight at its end are waited for) or `requests_each` requests a stream.
    `extras`: (delay after the start in seconds, request) run once each on a thread of its own; with them the window
    lasts until every extra has ended plus `tail_s`. A failed request is recorded (`error`) and ends its stream."""
    if (duration_s is None) == (requests_each is None):
        raise ValueError("give exactly one of duration_s and requests_each")
    records: list[Record] = []
    extra_records: list[Record] = []
    lock = threading.Lock()
    extras_done = threading.Event()
    if not extras:
        extras_done.set()
    started = time.perf_counter()
    window_end = [math.inf]  # set once known

    def open_for_more() -> bool:
        now = time.perf_counter()
        if duration_s is None:
            return True
        if now < started + duration_s:
            return True
        if not extras:
            return False
        if not extras_done.is_set():
            return True
        return now < window_end[0]

    def stream_loop(index: int) -> None:
        turn = 0
        while (requests_each is None or turn < requests_each) and open_for_more():
            record = Record(stream=index, turn=turn)
            try:
                request(index, turn, record)
            except Exception as error:  # kept in the record; the stream stops (the summary counts it)
                record.error = f"{type(error).__name__}: {error}"
                record.end = time.perf_counter()
                with lock:
                    records.append(record)
                return
            with lock:
                records.append(record)
            turn += 1

    def extra_loop(delay: float, call: Callable[[Record], Record]) -> None:
        time.sleep(max(0.0, started + delay - time.perf_counter()))
        record = Record(tag="extra")
        try:
            call(record)
        except Exception as error:
            record.error = f"{type(error).__name__}: {error}"
            record.end = time.perf_counter()
        with lock:
            extra_records.append(record)

    threads = [threading.Thread(target=stream_loop, args=(i,), daemon=True) for i in range(concurrency)]
    extra_threads = [threading.Thread(target=extra_loop, args=extra, daemon=True) for extra in extras]
    for thread in threads + extra_threads:
        thread.start()
    for thread in extra_threads:
        thread.join()
    if extras:
        last_extra = max((r.end or time.perf_counter()) for r in extra_records)
        window_end[0] = max(started + (duration_s or 0.0), last_extra + tail_s)
        extras_done.set()
    for thread in threads:
        thread.join()
    finished = time.perf_counter()
    if duration_s is None and not extras:
        end = max((r.end or finished) for r in records) if records else finished
    elif extras:
        end = window_end[0]
    else:
        end = started + duration_s
    return Run(records, extra_records, (started, end), finished - started)


# ------------------------------------------------------------------------------------------------------ summaries

def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def summarize(records: Sequence[Record], window: tuple[float, float] | None = None) -> dict:
    """tokens_per_s (tokens timed inside the window / its length; the window defaults to the first send to the
    last token), p50/p95 TTFT ms over the requests sent inside the window, p50 ITL ms over all gaps of those
    requests, plus counts (requests, tokens, errors)."""
    ok = [r for r in records if r.error is None]
    if window is None:
        times = [t for r in ok for t in r.token_times]
        window = (min((r.start for r in ok), default=0.0), max(times, default=0.0))
    begin, end = window
    inside = [r for r in ok if begin <= r.start <= end]
    tokens = sum(1 for r in ok for t in r.token_times if begin <= t <= end)
    span = end - begin
    ttfts = [r.ttft for r in inside if r.ttft is not None]
    gaps = [g for r in inside for g in r.gaps]
    return {"tokens_per_s": tokens / span if span > 0 else None,
            "p50_ttft_ms": _ms(percentile(ttfts, 50)), "p95_ttft_ms": _ms(percentile(ttfts, 95)),
            "p50_itl_ms": _ms(percentile(gaps, 50)), "requests": len(inside), "tokens": tokens,
            "errors": sum(1 for r in records if r.error is not None)}


def waiting_during(records: Sequence[Record], begin: float, end: float) -> list[Record]:
    """The requests that were waiting for their first token at some time in [begin, end] (sent before `end`,
    first token after `begin`)."""
    return [r for r in records if r.error is None and r.start < end
            and (r.first_token if r.first_token is not None else math.inf) > begin]


def max_gap_during(records: Sequence[Record], begin: float, end: float) -> float | None:
    """The longest gap between two tokens of one request that overlaps [begin, end], in seconds."""
    gaps = [b - a for r in records if r.error is None for a, b in zip(r.token_times, r.token_times[1:])
            if a < end and b > begin]
    return max(gaps, default=None)


# ---------------------------------------------------------------------------------------------------------- text

BOS, USER, END, ASSISTANT = "<|bos|>", "<|user|>", "<|end|>", "<|assistant|>"
TEXT_SOURCES = ("README.md", "docs/architecture.md", "docs/serving.md", "docs/operations.md", "docs/openai_api.md",
                "models/demo/README.md", "heterofold/README.md", "plugins/README.md")


def user_turn(text: str, first: bool = True) -> str:
    """The text our server's ChatTokenizer builds around a user turn (`<|bos|>` on the first turn, then
    `<|user|>text<|end|><|assistant|>`), as a string: the demo tokenizer maps each marker to its one special
    token, so vLLM sees the same token ids for the same turn."""
    return (BOS if first else "") + USER + text + END + ASSISTANT


def text_of_tokens(tokens: int, tokenizer, root, lead: str = "", wrapped_extra: int = 4) -> str:
    """Real text (this repository's READMEs, repeated) of `tokens - wrapped_extra` tokens under `tokenizer`
    (a `tokenizers.Tokenizer`), so that the wrapped first turn is `tokens` long; `lead` starts it (a distinct
    lead makes a distinct prefix for a prefix cache)."""
    from pathlib import Path

    corpus = "\n\n".join((Path(root) / name).read_text() for name in TEXT_SOURCES if (Path(root) / name).is_file())
    target = tokens - wrapped_extra
    if target <= 0:
        raise ValueError(f"{tokens} tokens leave no room for text")
    base = tokenizer.encode(lead).ids if lead else []
    body = tokenizer.encode(corpus).ids
    ids = list(base)
    while len(ids) < target + 8:
        ids += body
    cut = target
    for _ in range(16):  # decoding a cut and encoding it again can merge across the cut: nudge until exact
        text = tokenizer.decode(ids[:cut])
        count = len(tokenizer.encode(text).ids)
        if count == target:
            return text
        cut += target - count
    return text


# -------------------------------------------------------------------------------------------------------- servers

@contextlib.contextmanager
def demo_server(log_name: str, env: dict[str, str] | None = None, demo: str | None = None):
    """Our tritonserver on the demo as `mol2 serve` runs it (the committed model_repository/, only the models one
    server needs), fresh loopback ports and a conversation store in a temp folder: yields (ports, store folder).
    `demo`: a demo folder, as `mol2 serve --demo` (default: the one every command uses). Its log is
    artifacts/logs/LOG_NAME.log."""
    import tempfile
    from pathlib import Path

    from python_backend.server.launcher import Ports, running
    from python_backend.server.roles import single_server_models
    from python_backend.server.serve_cli import prepare_demo
    from python_backend.core.settings import ROOT

    model_dir = prepare_demo(demo)
    chosen = {"MOL2_MODEL_DIR": str(model_dir.resolve())} if demo else {}  # as serve_cli.engine_settings
    repository = ROOT / "model_repository"
    only_these = ["--model-control-mode=explicit", *(f"--load-model={name}" for name in single_server_models(repository))]
    logs = ROOT / "artifacts/logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports = Ports.free()
    with tempfile.TemporaryDirectory(prefix="mol2-store-") as store:
        print(f"starting tritonserver on the demo ({model_dir}); log {logs / f'{log_name}.log'}", flush=True)
        with running(repository, ports, ROOT / "artifacts/triton", logs / f"{log_name}.log",
                     env={"MOL2_ENGINE": "torch", "MOL2_STORE_DIR": store, **chosen, **(env or {})},
                     extra_args=only_these):
            yield ports, Path(store)


def server_rss_mb(http_port: int) -> float:
    """Resident memory of the tritonserver listening on `http_port` and all its descendants (model processes)."""
    parents, commands = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parents[int(pid)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                commands[int(pid)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    roots = [pid for pid, command in commands.items() if "tritonserver " in command and
             f"--http-port={http_port}" in command]
    tree, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    total_kb = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as status:
                total_kb += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total_kb / 1024


def folder_bytes(path) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@contextlib.contextmanager
def demo_pair(log_name: str, args: Sequence[str] = (), ready_timeout_s: float = 900.0):
    """A disaggregated pair on the demo as `mol2 serve` runs it (docs/disaggregated.md): `--role decode` and
    `--role prefill --decode-url` the decode server's gRPC port, on fresh loopback ports, each with its own store in
    one temp folder and one secret file there (written before either starts); `args` go to both (e.g. --engine,
    --max-prompt-tokens). Both start at once (the prefill server is ready only once its decode server answers).
    Yields (the prefill server's ports, the decode server's ports): clients talk to the prefill server as to a single
    server. Logs: artifacts/logs/LOG_NAME_{decode,prefill}.log (tritonserver's) and .out (`mol2 serve`'s)."""
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from python_backend.core.seal import create_secret_file
    from python_backend.core.settings import ROOT
    from python_backend.server.launcher import Ports

    logs = ROOT / "artifacts/logs"
    logs.mkdir(parents=True, exist_ok=True)
    mol2 = Path(sys.executable).parent / "mol2"
    command = [str(mol2)] if mol2.exists() else [sys.executable, "-m", "mol2_cli"]
    decode, prefill = Ports.free(), Ports.free()
    while {decode.http, decode.grpc, decode.metrics} & {prefill.http, prefill.grpc, prefill.metrics}:
        prefill = Ports.free()
    processes: list[tuple[str, subprocess.Popen, Path]] = []
    with tempfile.TemporaryDirectory(prefix="mol2-pair-") as work:
        secret = create_secret_file(Path(work) / "pair.secret")  # written once here: both servers read it
        try:
            for role, ports, extra in (("decode", decode, []), ("prefill", prefill, ["--decode-url", decode.grpc_url])):
                out = logs / f"{log_name}_{role}.out"
                argv = [*command, "serve", "--role", role, *extra, "--secret-file", str(secret),
                        "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
                        "--metrics-port", str(ports.metrics), "--openai-port", "0",
                        "--store", str(Path(work) / f"{role}-store"), "--log", str(logs / f"{log_name}_{role}.log"),
                        *args]
                with open(out, "ab") as handle:
                    processes.append((role, subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                                                             start_new_session=True), out))
            print(f"starting a disaggregated pair (mol2 serve --role decode on {decode.http_url}, --role prefill on "
                  f"{prefill.http_url}); logs {logs / log_name}_{{decode,prefill}}.{{log,out}}", flush=True)
            deadline = time.monotonic() + ready_timeout_s
            for role, process, out in processes:
                ports = decode if role == "decode" else prefill
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"mol2 serve --role {role} exited ({process.returncode}); see {out}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"mol2 serve --role {role} was not ready within {ready_timeout_s:.0f} s")
                    with contextlib.suppress(OSError, http.client.HTTPException):
                        connection = _connection(f"http://{ports.http_url}", 2.0)
                        try:
                            connection.request("GET", "/v2/health/ready")
                            if connection.getresponse().status == 200:
                                break
                        finally:
                            connection.close()
                    time.sleep(0.5)
            yield prefill, decode
        finally:
            for role, process, _ in reversed(processes):  # the prefill server first, then its decode server
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
                    try:
                        process.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
            import shutil

            shutil.rmtree(ROOT / "artifacts" / "triton" / f"prefill-repository-{prefill.grpc}", ignore_errors=True)
