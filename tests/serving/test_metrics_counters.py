"""The custom-metric counters of the Python models (python_backend/triton/metrics.py), with a stand-in for the
backend's metric objects (`triton_python_backend_utils` exists only inside a stub)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from python_backend.triton.metrics import Counters


class FakeBackend:
    """MetricFamily / Metric whose increment fails if two threads are inside the backend at once: the Python
    backend's stub-to-server metric messages are not safe to interleave (a SIGSEGV in tritonserver)."""

    def __init__(self):
        self.inside, self.overlaps, self.totals = 0, 0, {}
        self.guard = threading.Lock()
        backend = self

        class Metric:
            def __init__(self, key):
                self.key = key

            def increment(self, value):
                with backend.guard:
                    backend.inside += 1
                    backend.overlaps += backend.inside > 1
                time.sleep(0.0005)  # long enough for another thread to arrive
                with backend.guard:
                    backend.inside -= 1
                    backend.totals[self.key] = backend.totals.get(self.key, 0.0) + value

        class MetricFamily:
            COUNTER = "counter"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 - the backend's name
                return Metric((self.name, tuple(sorted(labels.items()))))

        self.MetricFamily = MetricFamily


def test_counting_from_many_threads_never_enters_the_backend_twice_at_once():
    backend = FakeBackend()
    counters = Counters(backend, "relay")
    with ThreadPoolExecutor(max_workers=16) as pool:
        for n in range(400):
            pool.submit(counters.count, "mol2_transfer_bytes_total", 10.0, direction="to_decode",
                        kind=("delta", "full")[n % 2])
    assert backend.overlaps == 0
    assert sorted(backend.totals.values()) == [2000.0, 2000.0]
