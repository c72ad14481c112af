"""Shape of the MoL2 pointer head: one frozen config, its presets, and the parameter count from the shape alone.

The query side is light (norm + one projection of pooled H19); the capacity sits on the option side, which sees
only token embeddings: an input projection, a deeper residual MLP, then self-attention within each option.
One cross-attention layer (the query reads every option token) and a q.k pointer score follow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class RouterConfigError(ValueError):
    """A head shape that cannot be built."""


@dataclass(frozen=True)
class RouterConfig:
    hidden_size: int = 64  # C: the backbone's hidden size (H19 width and token-embedding width)
    d_model: int = 32  # width of the head
    n_heads: int = 2  # heads of the option self-attention and of the cross-attention
    option_mlp_layers: int = 2  # residual MLP blocks on each option token (the "deeper MLP")
    option_attn_layers: int = 1  # self-attention layers within each option
    mlp_ratio: int = 4  # inner width of every MLP, times d_model
    max_option_tokens: int = 64  # route prompt + one description, after tokenization; longer is refused
    dropout: float = 0.0  # training only
    norm_eps: float = 1e-5
    # derived in __post_init__
    head_dim: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("hidden_size", "d_model", "n_heads", "mlp_ratio", "max_option_tokens"):
            if int(getattr(self, name)) <= 0:
                raise RouterConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("option_mlp_layers", "option_attn_layers"):
            if int(getattr(self, name)) < 0:
                raise RouterConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise RouterConfigError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if not 0 <= self.dropout < 1:
            raise RouterConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    def num_parameters(self) -> int:
        """Parameter count from the shape alone (no weights allocated); the tests check it against the module."""
        C, d, f = self.hidden_size, self.d_model, self.mlp_ratio * self.d_model
        norm = d  # RMSNorm weight
        mlp = norm + d * f + f + f * d + d  # pre-norm, up (with bias), down (with bias)
        attention = norm + 4 * (d * d + d)  # pre-norm, q/k/v/o with biases
        query = C + C * d + d  # norm over H19, projection
        option_in = C * d + d + d * self.max_option_tokens  # projection + learned position table
        option = option_in + self.option_mlp_layers * mlp + self.option_attn_layers * (attention + mlp) + norm
        cross = attention + mlp
        pointer = norm + 2 * (d * d + d)  # q and k of the pointer
        return query + option + cross + pointer

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @classmethod
    def from_dict(cls, values: dict) -> "RouterConfig":
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - names)
        if unknown:
            raise RouterConfigError(f"unknown router config fields: {unknown}")
        return cls(**values)

    def replace(self, **changes) -> "RouterConfig":
        return RouterConfig.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_name(cls, name: str, **overrides) -> "RouterConfig":
        if name not in PRESETS:
            raise RouterConfigError(f"unknown router preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # Tests: the tiny CED preset's hidden size.
    "tiny": dict(),
    # The served demo: the demo CED preset's hidden size (256), small enough to train on two CPU cores.
    "demo": dict(hidden_size=256, d_model=128, n_heads=4, option_mlp_layers=2, option_attn_layers=1, mlp_ratio=2,
                 max_option_tokens=96, dropout=0.1),
    # The seed's head at the 40-layer shape's hidden size (4096): about 15.25M parameters. Counted, never trained.
    "paper": dict(hidden_size=4096, d_model=512, n_heads=8, option_mlp_layers=2, option_attn_layers=1, mlp_ratio=4,
                  max_option_tokens=128, dropout=0.1),
}
