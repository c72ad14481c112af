"""The model families HeteroFold knows, registered in one place: each is its `FamilySpec` (sizes, tokenizer,
config and model classes), the `Adapter` class that captures and installs its K/V, the sizes the tests build it
at, and whether the benchmarks include it by default.

Everything that needs a family goes through here: `family(name)` (an unknown name is refused, naming the known
ones), `adapter_for(model, spec)`, `family_names()` and `directions()`. Adding a family is one `register(...)` call
below, plus an `Adapter` subclass when its attention is not `{q,k,v}_proj` on `self_attn` (heterofold/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import permutations

from .families import Adapter, FamilySpec, GPTNeoXAdapter
from .tokenizer import check_name


@dataclass(frozen=True)
class Family:
    spec: FamilySpec                                  # the zoo's model of the family
    adapter: type[Adapter] = Adapter                  # capture + install (a subclass where the attention differs)
    tiny: dict = field(default_factory=dict)          # FamilySpec sizes the tests build (a few thousand parameters)
    benchmarked: bool = True                          # in the default zoo and the benchmarks' default directions

    @property
    def name(self) -> str:
        return self.spec.name

    def tiny_spec(self) -> FamilySpec:
        return replace(self.spec, **self.tiny)


class UnknownFamily(ValueError):
    """A family name that is not registered."""


_FAMILIES: dict[str, Family] = {}


def register(entry: Family) -> Family:
    """Add a family; its name must be new and its tokenizer one that tokenizer.py provides."""
    if entry.name in _FAMILIES:
        raise ValueError(f"model family {entry.name!r} is already registered")
    check_name(entry.spec.tokenizer)
    _FAMILIES[entry.name] = entry
    return entry


def family(name: str) -> Family:
    if name not in _FAMILIES:
        raise UnknownFamily(f"unknown model family {name!r}: the registered families are "
                            f"{', '.join(sorted(_FAMILIES))} (heterofold/registry.py)")
    return _FAMILIES[name]


def family_names(benchmarked_only: bool = False) -> list[str]:
    """Registered families in registration order (the order the default directions follow)."""
    return [name for name, f in _FAMILIES.items() if f.benchmarked or not benchmarked_only]


def directions(names: list[str] | None = None) -> list[tuple[str, str]]:
    """Every (sender, receiver) pair of two different families; by default of the benchmarked ones."""
    return list(permutations(names if names is not None else family_names(benchmarked_only=True), 2))


def adapter_for(model, spec: FamilySpec) -> Adapter:
    """The registered adapter of `spec`'s family over `model` (a spec of another size, e.g. a zoo entry's own
    spec.json or a test's tiny spec, keeps its family's adapter)."""
    return family(spec.name).adapter(model, spec)


# Different depth, KV heads and head dim per family, as in the seed's Llama / Qwen3 / Ministral triple. The tiny
# sizes keep those differences at test scale.
register(Family(
    FamilySpec("llama", "LlamaConfig", "LlamaForCausalLM", "bpe",
               layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=384),
    tiny=dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64)))
register(Family(
    FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen",
               layers=6, hidden=128, heads=4, kv_heads=1, head_dim=48, intermediate=352,
               key_norm="k_norm", query_norm="q_norm"),
    tiny=dict(layers=3, hidden=32, heads=4, kv_heads=1, head_dim=12, intermediate=64)))
register(Family(
    FamilySpec("mistral", "MistralConfig", "MistralForCausalLM", "cl100k",
               layers=5, hidden=144, heads=6, kv_heads=3, head_dim=24, intermediate=384,
               extra={"sliding_window": None}),
    tiny=dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=6, intermediate=64)))
# GPT-NeoX (Pythia's layout): fused query_key_value, a quarter of each head rotated, parallel residual, no GQA
# (kv_heads = heads, head_dim = hidden // heads: its config has neither field). A byte-level BPE like Pythia's own.
# Not benchmarked by default: the README's tables cover the three above; `--directions gpt_neox:llama` runs it.
register(Family(
    FamilySpec("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "bpe",
               layers=3, hidden=160, heads=5, kv_heads=5, head_dim=32, intermediate=640,
               extra={"rotary_pct": 0.25, "use_parallel_residual": True}),
    GPTNeoXAdapter,
    tiny=dict(layers=2, hidden=32, heads=4, kv_heads=4, head_dim=8, intermediate=64),
    benchmarked=False))
