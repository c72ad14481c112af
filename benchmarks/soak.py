"""Soak: a bounded mixed workload against our tritonserver (the demo) for a set time, watching the server's memory
and the conversation store.

Each of `--streams` client threads runs conversations one after another, its choices drawn from a seeded
generator: a conversation has 1-5 streamed turns (max_tokens 8-48, adapters at random or routed) and then is
ended (`end_conversation`, most of them), abandoned (left to expire: the server's idle timeout is set short) or
cancelled mid-stream (the client drops the connection after a few tokens; the conversation is then ended or
abandoned). Every fifth conversation is a stateless chat instead (the `engine` model's `messages`, the prefix
cache), resent with its reply as the history grows. When the time is up the workload ends every conversation it
still holds, waits for the abandoned ones to expire, and measures the store again.

Memory is the resident set of tritonserver and its model processes, sampled every few seconds: `rss_start_mb`
after the warm-up (the first tenth of the run, at least one minute, so the pool and the prefix cache have grown to
what the workload needs), `rss_end_mb` at the end of the workload. The store should be back to its starting size.

    python -m benchmarks.soak [--minutes 20] [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

from . import load
from ._report import add_plot_option, markdown_table, plot_path, save_figure, write_json

COLUMNS = ["minutes", "turns", "conversations", "stateless", "cancelled", "abandoned", "rss_start_mb", "rss_end_mb",
           "rss_change_pct", "store_bytes_start", "store_bytes_end", "errors", "load_avg"]
ADAPTERS = ("chat", "agent", "coding", "design", None)  # None: routed by MoL2
WORDS = ("list", "file", "colour", "joke", "server", "button", "loop", "weekend", "package", "shadow", "log", "rain")


class Workload:
    def __init__(self, client: load.Mol2Client, seed: int):
        self.client, self.base = client, client.base
        self.rng = random.Random(seed)
        self.turns = self.conversations = self.stateless = self.cancelled = 0
        self.errors: list[str] = []
        self.open: set[str] = set()  # conversations to end at the end (not abandoned)
        self.abandoned: set[str] = set()
        self.lock = threading.Lock()

    def text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(3, 12)))

    def one(self) -> None:
        with self.lock:
            self.conversations += 1
            stateless = self.conversations % 5 == 0
        self._chat() if stateless else self._conversation()

    def _conversation(self) -> None:
        cid, turns = None, self.rng.randint(1, 5)
        fate = self.rng.choices(("end", "abandon", "cancel"), (0.75, 0.15, 0.10))[0]
        for turn in range(turns):
            last = turn == turns - 1
            cancel = fate == "cancel" and last
            body = self.client._body(self.text(), self.rng.choice(ADAPTERS), self.rng.randint(8, 48), cid,
                                     last and fate == "end", True)
            cid = self._stream(body, cancel_after=2 if cancel else None) or cid
            with self.lock:
                self.turns += 1
            if cid is None:
                return  # the turn failed (counted): nothing to continue
        with self.lock:
            if fate == "abandon":
                self.abandoned.add(cid)
            elif fate == "cancel":  # its last turn was dropped: the conversation is still there, unless it was new
                self.cancelled += 1
                self.open.add(cid)

    def _chat(self) -> None:
        messages = [{"role": "user", "content": self.text()}]
        for _ in range(self.rng.randint(1, 4)):
            reply = []
            body = {"messages": json.dumps(messages), "max_tokens": self.rng.randint(8, 32), "stream": True,
                    "adapter": self.rng.choice(ADAPTERS[:4])}
            try:
                for event in load.post_sse(self.base, "/v2/models/engine/generate_stream", body, 300):
                    reply.append(event.get("text_output", ""))
            except Exception as error:  # noqa: BLE001 - counted, the workload goes on
                self._error(error)
                return
            messages += [{"role": "assistant", "content": "".join(reply)}, {"role": "user", "content": self.text()}]
            with self.lock:
                self.turns += 1
                self.stateless += 1

    def _stream(self, body: dict, cancel_after: int | None) -> str | None:
        """One streamed turn; its conversation id (None when it failed)."""
        cid, seen = body.get("conversation_id"), 0
        try:
            for event in load.post_sse(self.base, "/v2/models/mol2/generate_stream", body, 300):
                cid = event.get("conversation_id_out", cid)
                seen += 1
                if cancel_after is not None and seen >= cancel_after:
                    break  # drops the connection mid-stream
        except Exception as error:  # noqa: BLE001
            self._error(error)
            return None
        return cid

    def _error(self, error: Exception) -> None:
        with self.lock:
            self.errors.append(f"{type(error).__name__}: {error}")

    def finish(self) -> None:
        """End every conversation the workload still holds (a cancelled one may still be finishing its turn)."""
        for cid in sorted(self.open):
            for _ in range(20):
                try:
                    load.post_json(self.base, "/v2/models/mol2/generate",
                                   self.client._body("bye", "chat", 1, cid, True, False), 60)
                    break
                except load.ServerError as error:
                    if "unknown conversation_id" in str(error):
                        break  # a new conversation whose only turn was cancelled: never stored
                    if "in progress" not in str(error):
                        self._error(error)
                        break
                    time.sleep(0.5)


def soak(ports, store, minutes: float, streams: int, idle_s: float, seed: int) -> tuple[dict, list]:
    client = load.Mol2Client(f"http://{ports.http_url}")
    workload = Workload(client, seed)
    store_start = load.folder_bytes(store)
    began = time.perf_counter()
    end = began + minutes * 60
    warm_until = began + max(60.0, minutes * 6)  # a tenth of the run, at least a minute
    samples, rss_start = [], None

    def stream_loop() -> None:
        while time.perf_counter() < end:
            workload.one()

    threads = [threading.Thread(target=stream_loop, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        now = time.perf_counter()
        rss = load.server_rss_mb(ports.http)
        samples.append(((now - began) / 60, rss, workload.turns))
        if rss_start is None and now >= warm_until:
            rss_start = rss
        time.sleep(5)
    rss_end = load.server_rss_mb(ports.http)
    samples.append(((time.perf_counter() - began) / 60, rss_end, workload.turns))
    workload.finish()
    print(f"workload done after {(time.perf_counter() - began) / 60:.1f} min; waiting {idle_s + 75:.0f} s for the "
          f"{len(workload.abandoned)} abandoned conversations to expire", flush=True)
    time.sleep(idle_s + 75)  # the idle timeout, plus the server's expiry pass (every 60 s)
    rss_start = rss_start if rss_start is not None else samples[0][1]
    row = {"minutes": round(minutes, 2), "turns": workload.turns, "conversations": workload.conversations,
           "stateless": workload.stateless, "cancelled": workload.cancelled, "abandoned": len(workload.abandoned),
           "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
           "rss_change_pct": round(100 * (rss_end - rss_start) / rss_start, 1),
           "store_bytes_start": store_start, "store_bytes_end": load.folder_bytes(store),
           "errors": len(workload.errors), "load_avg": load.load_avg()}
    for error in sorted(set(workload.errors))[:10]:
        print(f"  error: {error}")
    return row, samples


def plot(samples, row, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot([s[0] for s in samples], [s[1] for s in samples], label="server RSS (MB)")
    axis.axhline(row["rss_start_mb"], linestyle=":", color="grey", label="after warm-up")
    axis.set_xlabel("minutes")
    axis.set_ylabel("MB")
    axis.set_title(f"soak: {row['turns']} turns, {row['errors']} errors, RSS {row['rss_change_pct']:+.1f} %")
    axis.legend()
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=None, help="workload time (default 20; --quick 1.5)")
    parser.add_argument("--streams", type=int, default=6, help="client threads (default 6)")
    parser.add_argument("--idle-s", type=float, default=30.0, help="the server's idle timeout for this run")
    parser.add_argument("--prefix-cache-mb", type=int, default=128, help="the server's prefix cache budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke check)")
    parser.add_argument("--json", help="write the row as JSON")
    add_plot_option(parser, "artifacts/benchmarks/soak.png")
    args = parser.parse_args(argv)
    minutes = args.minutes or (1.5 if args.quick else 20.0)
    # a prefix cache small enough to fill during the warm-up, so what follows shows whether memory stays put
    env = {"MOL2_IDLE_TIMEOUT_S": str(args.idle_s), "MOL2_PREFIX_CACHE_MB": str(args.prefix_cache_mb)}
    with load.demo_server("soak", env) as (ports, store):
        row, samples = soak(ports, store, minutes, args.streams, args.idle_s, args.seed)
    print(f"\n{args.streams} streams for {minutes} min; idle timeout {args.idle_s:.0f} s\n")
    print(markdown_table([row], COLUMNS))
    within = abs(row["rss_change_pct"]) <= 10
    print(f"\nserver memory at the end within 10 % of the start after warm-up: {'yes' if within else 'NO'} "
          f"({row['rss_change_pct']:+.1f} %); store back to its starting size: "
          f"{'yes' if row['store_bytes_end'] == row['store_bytes_start'] else 'NO'} "
          f"({row['store_bytes_start']} -> {row['store_bytes_end']} bytes)")
    plot(samples, row, plot_path(args))
    if args.json:
        write_json([row], args.json)
    return [row]


if __name__ == "__main__":
    main()
