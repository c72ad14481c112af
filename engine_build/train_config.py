"""The training settings of the demo's pretraining and adapters, apart from the training code: `mol2 build --help`
reads their defaults without loading torch (engine_build/pretrain.py and adapters.py use them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .corpus import DOMAINS

DEFAULT_WEIGHTS = {"general": 0.5, "coding": 0.2, "design": 0.1, "agent": 0.1, "chat": 0.1}


@dataclass
class PretrainConfig:
    preset: str = "demo"
    tokens: int = 1_600_000  # training budget in tokens (rounded down to whole steps)
    seq_len: int = 512  # tokens per packed row
    batch_size: int = 4  # rows per step
    lr: float = 2e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 40
    weight_decay: float = 0.1  # on matrices only (not norms)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0  # initial weights, row choice and row order
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))  # domain mixture
    valid_rows: int = 40  # validation rows, mixed by `weights` (capped by what each domain's split holds)
    eval_every: int = 60  # steps between validation losses
    ckpt_every: int = 25  # steps between checkpoints
    bf16: bool = True  # autocast matmuls to bfloat16 (weights, AdamW and the loss stay float32)
    chunk_size: int = 128  # queries per model chunk in the training forward (the result does not depend on it)
    # derived in __post_init__
    tokens_per_step: int = field(init=False)
    steps: int = field(init=False)

    def __post_init__(self):
        self.betas = tuple(self.betas)
        unknown = sorted(set(self.weights) - set(DOMAINS))
        if unknown:
            raise ValueError(f"unknown domains in weights: {unknown}; choose from {DOMAINS}")
        self.tokens_per_step = self.batch_size * self.seq_len
        self.steps = self.tokens // self.tokens_per_step
        if self.steps <= self.warmup_steps:
            raise ValueError(f"{self.tokens} tokens make {self.steps} steps, not more than warmup_steps="
                             f"{self.warmup_steps}")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def lr_at(self, step: int) -> float:
        """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class AdapterTrainConfig:
    rank: int = 16
    alpha: float = 32.0
    lr: float = 2e-3  # peak; linear warmup then cosine to lr / 10
    steps: int = 100  # optimizer steps per adapter
    warmup_steps: int = 4
    batch_size: int = 4  # rows per step
    seq_len: int = 512
    valid_rows: int = 32  # most validation rows scored per domain
    max_doc_tokens: int = 1024  # one random window of at most this many tokens per document (train and valid)
    seed: int = 0  # LoRA A initialisation, row choice and order
    bf16: bool = True  # autocast the training matmuls (scoring is float32)
    chunk_size: int = 128  # queries per model chunk
    every_layer_domain: str = "chat"  # the data the every-layer (baseline) adapter learns
    random_rank: int = 8  # random_l0
    random_scale: float = 0.08  # random_l0: A, B ~ N(0, scale^2) (demo: mean |logit change| 0.12)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
