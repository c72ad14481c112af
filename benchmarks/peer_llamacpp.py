"""The benchmark peer llama.cpp: `llama-server` serving the vLLM peer's Llama (benchmarks/peer_vllm.py: the demo's
exact shape, random seeded weights, the demo tokenizer) and its 4 PEFT LoRA adapters, converted to GGUF.

llama.cpp lives in a folder of its own, .peers/llamacpp (`bash scripts/install_llamacpp.sh`: llama-server and
llama-bench built from the tree the llama-cpp-python sdist vendors, and a venv for its converters).
`convert_peer` writes artifacts/peer/gguf/ (cached): the model at bf16, its checkpoint's dtype, as our engine reads
the demo's bfloat16 weights (2 bytes a weight: ced/kernels), and each adapter at f32, as our engine holds LoRA
(convert_lora_to_gguf.py). The demo tokenizer is a byte-level BPE whose pre-tokenizer is GPT-2's regex, which the
converter cannot recognise by its hash (it knows released models only), so the conversion names it `gpt-2`
(PRE_TOKENIZER); `tokenizer_mismatch` checks against the demo tokenizer that llama-server then makes the same ids.

`running_llamacpp(gguf, port)` starts `llama-server -t 2` with the 4 adapters loaded at scale 0
(`--lora-scaled FILE:0,...`); a request picks its adapter with the `lora` field ([{"id": i, "scale": 1}]: PEFT's
alpha / r is in the GGUF, so scale 1 is the adapter as trained). 16 slots over one unified 32K KV buffer, continuous
batching and its prompt cache on (the defaults). llama-server batches only requests whose adapters are the same.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path

from python_backend.server.launcher import stop

from . import load
from .peer_vllm import ADAPTERS, LORA_NAMES, PEER_ROOT, build_peer

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".peers" / "llamacpp"
SERVER, BENCH = HOME / "bin" / "llama-server", HOME / "bin" / "llama-bench"
CONVERT_PYTHON, SOURCE = HOME / "venv" / "bin" / "python", HOME / "src"
INSTALLED = HOME / "installed.txt"
SKIP_MESSAGE = "llama.cpp rows skipped: run scripts/install_llamacpp.sh"
THREADS = 2
SLOTS = 16
CONTEXT = 32768
PRE_TOKENIZER = "gpt-2"
MODEL_OUTTYPE, ADAPTER_OUTTYPE = "bf16", "f32"
MODEL_FILE = f"model-{MODEL_OUTTYPE}.gguf"
LORA_IDS = {name: index for index, name in enumerate(ADAPTERS)}  # ours -> llama-server's adapter id (--lora order)

# Runs in the converters' venv: the vendored gguf-py first (the converters import it; it matches the tree), the
# pre-tokenizer named (see the module's docstring), then convert_hf_to_gguf.py as its own __main__.
_CONVERT_MODEL = """
import runpy, sys
source, pre, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [source + "/gguf-py", source]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [source + "/convert_hf_to_gguf.py", *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llamacpp_available(home: Path = HOME) -> bool:
    """True when scripts/install_llamacpp.sh has finished in `home` (its stamp) and its binaries and converters are
    there."""
    needed = ("installed.txt", "bin/llama-server", "bin/llama-bench", "venv/bin/python", "src/convert_hf_to_gguf.py",
              "src/convert_lora_to_gguf.py")
    return all((Path(home) / name).is_file() for name in needed)


def installed_version() -> str:
    return INSTALLED.read_text().strip() if INSTALLED.is_file() else "not installed"


def _run(what: str, command: list[str], log: Path) -> None:
    with open(log, "ab") as handle:
        done = subprocess.run(command, check=False, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}); log {log}")


def convert_peer(root: Path = PEER_ROOT, force: bool = False) -> Path:
    """root/gguf/: MODEL_FILE and adapters a0..a3 (`<name>-f32.gguf`), converted from the peer (built first
    where missing); returns that folder. Skips the work when `converted.json` (written last) names the same peer
    and llama.cpp."""
    root = build_peer(root)
    out = root / "gguf"
    marker = out / "converted.json"
    stamp = {"peer": json.loads((root / "built.json").read_text()), "llamacpp": installed_version(),
             "pre_tokenizer": PRE_TOKENIZER, "outtype": [MODEL_OUTTYPE, ADAPTER_OUTTYPE]}
    if marker.is_file() and not force and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    log = ROOT / "artifacts" / "logs" / "llamacpp_convert.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _run("convert_hf_to_gguf.py", [str(CONVERT_PYTHON), "-c", _CONVERT_MODEL, str(SOURCE), PRE_TOKENIZER,
                                   str(root / "model"), "--outtype", MODEL_OUTTYPE, "--outfile", str(out / MODEL_FILE)],
         log)
    for name in LORA_NAMES.values():
        _run(f"convert_lora_to_gguf.py ({name})",
             [str(CONVERT_PYTHON), str(SOURCE / "convert_lora_to_gguf.py"), str(root / "adapters" / name), "--base",
              str(root / "model"), "--outtype", ADAPTER_OUTTYPE, "--outfile", str(adapter_file(out, name))], log)
    marker.write_text(json.dumps(stamp, indent=2))
    return out


def adapter_files(gguf: Path) -> list[Path]:
    """The adapters' GGUF files in llama-server's id order."""
    return [adapter_file(gguf, name) for name in LORA_NAMES.values()]


def adapter_file(gguf: Path, name: str) -> Path:
    return Path(gguf) / f"{name}-{ADAPTER_OUTTYPE}.gguf"


def server_command(gguf: Path, port: int) -> list[str]:
    gguf = Path(gguf)
    # Every adapter at scale 0 unless a request's `lora` names it: --lora-scaled FILE:0,... (one flag, the files
    # comma-separated: given several times llama-server keeps only the last; and --lora-init-without-apply does
    # not do it, a request without `lora` still gets the loaded scales, 1 by default)
    return [str(SERVER), "-m", str(gguf / MODEL_FILE),
            "--lora-scaled", ",".join(f"{path}:0" for path in adapter_files(gguf)),
            "-t", str(THREADS), "-tb", str(THREADS), "-np", str(SLOTS), "-c", str(CONTEXT), "--kv-unified",
            "--host", "127.0.0.1", "--port", str(port), "--no-webui"]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # 503 while the model loads, refused before it listens
        return False


@contextlib.contextmanager
def running_llamacpp(gguf: Path, port: int, log_path: Path | None = None, timeout_s: float = 300.0):
    """llama-server on 127.0.0.1:`port`, ready (its /health answers 200) inside the block; its process group is
    stopped after it. Yields the base URL."""
    log_path = Path(log_path or ROOT / "artifacts" / "logs" / "llamacpp.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(server_command(gguf, port), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=ROOT)
        try:
            deadline = time.monotonic() + timeout_s
            while not _ready(port):
                if process.poll() is not None:
                    raise RuntimeError(f"llama-server exited with code {process.returncode} before it was ready; "
                                       f"log {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server was not ready within {timeout_s:.0f} s; log {log_path}")
                time.sleep(0.5)
            base = f"http://127.0.0.1:{port}"
            loaded = [entry["path"] for entry in json.loads(load.get_text(base, "/lora-adapters"))]
            if loaded != [str(path) for path in adapter_files(gguf)]:
                raise RuntimeError(f"llama-server loaded the adapters {loaded}, not the peer's 4 in order")
            yield base
        finally:
            stop(process)


def lora_field(adapter: str | None) -> list[dict]:
    """The request's `lora`: our adapter at scale 1 (those not named are 0); for the base model every adapter at 0,
    named (a request without the field keeps the slot's cache even when it was written under an adapter)."""
    if adapter in (None, "", "base"):
        return [{"id": index, "scale": 0.0} for index in LORA_IDS.values()]
    return [{"id": LORA_IDS[adapter], "scale": 1.0}]


class LlamaCppClient:
    """llama-server's own /completion (the endpoint whose `lora` field picks an adapter per request), greedy,
    `ignore_eos`; streamed answers carry their token ids (`return_tokens`), so an event's count is exact, and the
    final event's `tokens_predicted` covers tokens that had none."""

    def __init__(self, base: str, timeout: float = 900.0):
        self.base, self.timeout = base, timeout

    def _body(self, prompt: str, adapter: str | None, max_tokens: int, stream: bool) -> dict:
        return {"prompt": prompt, "n_predict": max_tokens, "stream": stream, "ignore_eos": True, "temperature": 0.0,
                "lora": lora_field(adapter), "return_tokens": True, "cache_prompt": True}

    def stream(self, prompt: str, adapter: str | None, max_tokens: int, record: load.Record | None = None
               ) -> load.Record:
        record = record or load.Record(engine="llamacpp", adapter=adapter or "")
        record.start, record.token_times = time.perf_counter(), []
        for event in load.post_sse(self.base, "/completion", self._body(prompt, adapter, max_tokens, True),
                                   self.timeout):
            now = time.perf_counter()
            record.add_tokens(len(event.get("tokens") or []), now)
            if event.get("stop"):
                # tokens whose text is an incomplete UTF-8 sequence may never get an event of their own: the final
                # event's count says how many there were, and they arrived by then
                record.add_tokens(int(event.get("tokens_predicted") or 0) - record.tokens, now)
                if event.get("tokens_evaluated") is not None:
                    record.prompt_tokens = int(event["tokens_evaluated"])
        record.end = time.perf_counter()
        return record

    def complete(self, prompt: str, adapter: str | None, max_tokens: int) -> tuple[dict, float]:
        """One non-streamed completion: (the answer's JSON, with `timings`, client-observed seconds)."""
        started = time.perf_counter()
        answer = load.post_json(self.base, "/completion", self._body(prompt, adapter, max_tokens, False),
                                self.timeout)
        return answer, time.perf_counter() - started


def tokenizer_mismatch(base: str, tokenizer, root: Path = ROOT) -> str | None:
    """None when llama-server tokenizes a wrapped turn of real text (special markers included) exactly as the demo
    tokenizer (`tokenizers.Tokenizer`) does; else what differs. Without that the rows would not compare the same
    work."""
    text = load.user_turn(load.text_of_tokens(300, tokenizer, root))
    ours = tokenizer.encode(text).ids
    theirs = load.post_json(base, "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
    if ours == theirs:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (f"llama-server's tokens differ from the demo tokenizer's at position {first} "
            f"({len(theirs)} against {len(ours)} tokens)")


def start_client(stack: contextlib.ExitStack, log: Path, tokenizer, port: int, root: Path = ROOT) -> LlamaCppClient:
    """llama-server on the converted peer, inside `stack` (stopped with it), checked to tokenize as ours does."""
    gguf = convert_peer(PEER_ROOT)
    print(f"starting llama-server on the peer ({gguf}); log {log}", flush=True)
    base = stack.enter_context(running_llamacpp(gguf, port, log))
    mismatch = tokenizer_mismatch(base, tokenizer, root)
    if mismatch:
        raise RuntimeError(mismatch)
    return LlamaCppClient(base)


def llama_bench(gguf: Path, threads: int = THREADS, generate: int = 128, prompt: int = 512) -> list[dict]:
    """llama-bench on the peer's GGUF (no adapter): pp`prompt` and tg`generate` tokens/s, its JSON rows."""
    done = subprocess.run([str(BENCH), "-m", str(Path(gguf) / MODEL_FILE), "-t", str(threads),
                           "-p", str(prompt), "-n", str(generate), "-o", "json"],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-500:]}")
    return json.loads(done.stdout)


def main() -> None:
    if not llamacpp_available():
        print(SKIP_MESSAGE)
        return
    gguf = convert_peer()
    print(f"peer converted in {gguf} ({installed_version()}); llama-bench, {THREADS} threads:")
    for row in llama_bench(gguf):
        kind = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        print(f"  {kind}: {row['avg_ts']:.1f} tok/s (+- {row['stddev_ts']:.1f})")


if __name__ == "__main__":
    main()
