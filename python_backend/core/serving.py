"""What a Triton model that runs the CED model builds in `initialize` from its settings (python_backend/core/settings.py):
the engine, the conversation store, the tokenizer and the adapter-set watcher."""

from __future__ import annotations

import faulthandler
import logging
from dataclasses import dataclass

import torch

from ced.batched import BatchedEngine
from ced.engine import CEDEngine
from ced.engines import make_engine
from ced.ort_batched import OrtBatchedEngine
from ced.ort_engine import OrtCEDEngine
from ced.row_engine import RowEngine
from ced.tokenization import ChatTokenizer

from .adapter_set import AdapterSet, AdapterSetWatcher, sync_registry
from .fnv import BASE
from .inputs import RequestError
from .settings import ServingSettings
from .store import ConversationStore

log = logging.getLogger("mol2.engine")


def start_model_process(settings: ServingSettings) -> None:
    """What every model process that runs torch sets first."""
    faulthandler.enable(all_threads=True)  # a model process that crashes leaves its Python stacks in the log
    torch.set_num_threads(settings.threads)


@dataclass
class Served:
    """What a stage needs: the engine (adapters synced to the set), the store, the tokenizer, the set watcher."""

    settings: ServingSettings
    engine: CEDEngine
    store: ConversationStore
    tokenizer: ChatTokenizer
    watcher: AdapterSetWatcher
    fingerprints: dict
    load_errors: dict  # adapter name -> why it is in the set but not loaded
    synced: object = None  # the adapter set the engine's registry holds (sync_current)

    @classmethod
    def open(cls, settings: ServingSettings, with_adapters: bool = True) -> "Served":
        """`with_adapters=False`: the torch engine gets no LoRA slots (the adapter-free prefill stage never runs
        one); an exported engine keeps them, as its graphs take the LoRA inputs whatever the stage."""
        start_model_process(settings)
        slots = settings.max_adapters if with_adapters or settings.engine != "torch" else 0
        engine = make_engine(settings.engine, settings.model_dir, slots, settings.max_rank, settings.engine_dir,
                             settings.threads)
        log.info("serving %s with %s (--engine %s)", settings.model_dir, type(engine).__name__, settings.engine)
        served = cls(settings, engine, settings.open_store(engine.config),
                     ChatTokenizer(settings.model_dir), AdapterSetWatcher(settings.adapter_set), {}, {})
        if with_adapters:
            sync_registry(engine.adapters, served.watcher.current, served.fingerprints, served.load_errors)
            served.synced = served.watcher.current
        return served

    def serving_engine(self, chunk_threads: int | None = None, capacity_bytes: int = 0) -> BatchedEngine | RowEngine:
        """What the scheduler drives: the ced family's engine over its paged pool, batched, on torch or on ONNX
        Runtime's pool graphs; any other (TensorRT, the deepseek_v41 family) a row at a time (ced/row_engine.py)."""
        if type(self.engine) is OrtCEDEngine:  # on the engine's threads: two read 0.45x torch at 16 streams, one 0.49x
            return OrtBatchedEngine(self.engine, capacity_bytes=capacity_bytes, threads=self.settings.threads)
        if self.settings.engine == "torch" and isinstance(self.engine, CEDEngine):
            return BatchedEngine(self.engine, chunk_threads=chunk_threads, capacity_bytes=capacity_bytes)
        return RowEngine(self.engine)

    def adapter_for(self, adapter_set: AdapterSet, adapter_hash: int) -> str | None:
        """The engine's name of the adapter a routing decision names by hash (None: the base model); refused when
        this process does not have it loaded."""
        if adapter_hash == BASE:
            return None
        entry = adapter_set.by_hash(adapter_hash)
        if entry is not None and entry.name in self.load_errors:
            raise RequestError(f"adapter {entry.name!r} is in the adapter set but failed to load: "
                               f"{self.load_errors[entry.name]}")
        if entry is None or entry.name not in self.engine.adapters:
            raise RequestError(f"the transfer names adapter hash {adapter_hash}, which this server does not have "
                               "loaded (its adapter set differs from the prefill server's)")
        return entry.name

    def sync_current(self) -> list[str]:
        """For an engine that runs on a thread of its own, between its steps: bring the registry to the set the
        watcher last read (requests poll the file as they arrive, on another thread). Returns what changed."""
        current = self.watcher.current
        if current is self.synced:
            return []
        self.synced = current
        return sync_registry(self.engine.adapters, current, self.fingerprints, self.load_errors)

    def refresh(self) -> list[str]:
        """Take a changed adapter-set file (live configuration): load, replace or unload adapters."""
        if self.watcher.poll():
            return sync_registry(self.engine.adapters, self.watcher.current, self.fingerprints, self.load_errors)
        return []
