"""Shape of a causal encoder-decoder (CED) model: one frozen config, its presets and its per-layer role table.

The lower `decoder_start` layers are the *encoder* (never adapted); the rest are the *decoder* (adapters allowed,
except on the first decoder layer's attention). Source layers compress blocks of their adapter-free input into
the global KV; index layers pick the top-k global entries each query attends to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes: the config is read where torch is not loaded


class ConfigError(ValueError):
    """A CED shape that breaks one of the rules the engine relies on."""


@dataclass(frozen=True)
class LayerRole:
    """What one layer does, expanded once from the config."""

    index: int
    is_decoder: bool
    is_source: bool  # compresses its input into global KV entries + indexer keys
    is_index: bool  # computes indexer queries and picks the top-k global entries
    global_source: int | None  # whose global KV this layer reads (nearest source at or below), None = local only
    selection_layer: int | None  # whose top-k choice this layer reuses (nearest index layer at or below)


@dataclass(frozen=True)
class CEDConfig:
    n_layers: int = 6
    decoder_start: int = 3  # E: layers 0..E-1 are the encoder, E is the first decoder layer
    hidden_size: int = 64
    n_heads: int = 4
    head_dim: int = 16
    ffn_hidden: int = 128  # SwiGLU inner width
    window: int = 16  # W: local attention covers the last W positions (the query included)
    block_size: int = 4  # m: tokens compressed into one global KV entry
    source_layers: tuple[int, ...] = (1, 3)
    index_layers: tuple[int, ...] = (1, 3, 5)
    index_top_k: int = 4  # global entries each query attends to
    index_heads: int = 2
    index_dim: int = 16
    vocab_size: int = 320
    max_context: int = 4096  # the longest conversation a state may hold
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    # derived in __post_init__
    roles: tuple[LayerRole, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._validate()
        object.__setattr__(self, "source_layers", tuple(sorted(self.source_layers)))
        object.__setattr__(self, "index_layers", tuple(sorted(self.index_layers)))
        object.__setattr__(self, "roles", self._expand_roles())

    def _validate(self):
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        for name in ("n_layers", "hidden_size", "n_heads", "head_dim", "ffn_hidden", "window", "block_size",
                     "index_top_k", "index_heads", "index_dim", "vocab_size", "max_context"):
            need(int(getattr(self, name)) > 0, f"{name} must be a positive integer, got {getattr(self, name)!r}")
        L, E = self.n_layers, self.decoder_start
        need(0 < E < L - 1, f"decoder_start={E} must leave at least one encoder layer and two decoder layers "
                            f"(n_layers={L})")
        for name in ("source_layers", "index_layers"):
            layers = getattr(self, name)
            need(len(set(layers)) == len(layers), f"{name} has duplicates: {layers}")
            bad = [i for i in layers if not 0 <= i < L]
            need(not bad, f"{name} {bad} out of range 0..{L - 1}")
        need(E in self.source_layers, f"the first decoder layer ({E}) must be a global-KV source, "
                                      f"got source_layers={tuple(self.source_layers)}")
        late = [i for i in self.source_layers if i > E]
        need(not late, f"source layers {late} lie above the first decoder layer {E}: a decoder source would make "
                       "the global KV depend on the adapter")
        missing = [i for i in self.source_layers if i not in self.index_layers]
        need(not missing, f"source layers {missing} must also be index layers (each source starts a new top-k choice)")
        early = [i for i in self.index_layers if i < min(self.source_layers)]
        need(not early, f"index layers {early} lie below the first source {min(self.source_layers)}: "
                        "nothing to index there")
        need(self.window >= self.block_size, f"window ({self.window}) must be at least block_size ({self.block_size})")
        need(self.norm == "rmsnorm", f"norm must be 'rmsnorm', got {self.norm!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")

    def _expand_roles(self) -> tuple[LayerRole, ...]:
        roles, source, selector = [], None, None
        for i in range(self.n_layers):
            source = i if i in self.source_layers else source
            selector = i if i in self.index_layers else selector
            roles.append(LayerRole(i, i >= self.decoder_start, i in self.source_layers, i in self.index_layers,
                                   source, selector if source is not None else None))
        return tuple(roles)

    # -- derived facts -------------------------------------------------------------------------------------

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def encoder_layers(self) -> range:
        return range(self.decoder_start)

    @property
    def adapter_bound_layers(self) -> range:
        """Decoder layers above the first: their local windows depend on the adapter."""
        return range(self.decoder_start + 1, self.n_layers)

    @property
    def h19_layer(self) -> int:
        """The last encoder layer; its output (H19 in the 40-layer shape) feeds the router."""
        return self.decoder_start - 1

    def num_parameters(self) -> int:
        """Parameter count from the shape alone (no weights allocated)."""
        C, F, HD = self.hidden_size, self.ffn_hidden, self.n_heads * self.head_dim
        attention = 3 * C * HD + HD * C
        ffn = 3 * C * F
        per_layer = attention + ffn + 2 * C  # two RMSNorm weights
        source = C * self.n_heads + C * self.index_dim  # compressor gate + indexer key projection
        index = C * self.index_heads * self.index_dim + C * self.index_heads  # indexer query + head weights
        embeddings = self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        return (self.n_layers * per_layer + len(self.source_layers) * source + len(self.index_layers) * index
                + embeddings + C)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict) -> "CEDConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"unknown CED config fields: {unknown}")
        values = {k: tuple(v) if k in ("source_layers", "index_layers") else v for k, v in values.items()}
        return cls(**values)

    def replace(self, **changes) -> "CEDConfig":
        return CEDConfig.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_name(cls, name: str, **overrides) -> "CEDConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # Tests: under 1M parameters, every role present (encoder source, decoder index layer, >1 adapter-bound layer).
    "tiny": dict(),
    # The served default: the 40-layer shape's roles at 8 layers (encoder 0-3, decoder 4-7, sources 1/3/4,
    # index layers 1/3/4/6), sized to train on CPU. Vocabulary matches the demo BPE tokenizer.
    "demo": dict(n_layers=8, decoder_start=4, hidden_size=256, n_heads=4, head_dim=64, ffn_hidden=768,
                 window=128, block_size=8, source_layers=(1, 3, 4), index_layers=(1, 3, 4, 6), index_top_k=16,
                 index_heads=4, index_dim=32, vocab_size=8192, max_context=32768, tie_word_embeddings=True),
    # docs/architecture.md §1's 40-layer roles on this family's components, at the seed's sizes (config and
    # parameter count only; dense SwiGLU stands in for the MoE FFN). Never instantiated in CI. The real
    # DeepSeek-V4.1-Flash is the `deepseek_v41` family's `deepseek-v4.1-flash` preset (ced/deepseek_v41/config.py).
    "ced-40": dict(n_layers=40, decoder_start=20, hidden_size=4096, n_heads=64, head_dim=128, ffn_hidden=2048,
                   window=128, block_size=4, source_layers=(2, 8, 14, 20), index_layers=(2, 8, 14, 20, 24, 28, 32, 36),
                   index_top_k=512, index_heads=64, index_dim=128, vocab_size=129280, max_context=1048576,
                   dtype="bfloat16"),
}
