"""The model zoo: one small model per family, each with its own real tokenizer, trained briefly on offline text.

Cached under artifacts/heterofold/zoo/<family>/ (weights, tokenizer tables, training log); reproducible from a
fixed seed. A quarter of the training sequences are "Question: s / Repeat: s" pairs so the models learn to copy,
which the question-reconstruction evaluation relies on.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import corpus, registry
from .families import Adapter, FamilySpec
from .tokenizer import TextTokenizer

ROOT = Path("artifacts/heterofold")


@dataclass
class TrainConfig:
    steps: int = 500          # optimizer steps
    batch: int = 8            # sequences per step
    seq_len: int = 256        # tokens per sequence
    lr: float = 3e-3
    vocab_size: int = 8192    # compact embedding rows (real ids beyond the most frequent map to unknown)
    copy_frac: float = 0.25   # share of "Question: s / Repeat: s" sequences
    seed: int = 0
    threads: int = 1


def repeat_prompt(question: str) -> str:
    return f"Question: {question}\nRepeat:"


def _sequences(tok: TextTokenizer, docs: list[str], cfg: TrainConfig, rng: random.Random):
    """Endless stream of seq_len id windows, mixing plain text and copy pairs."""
    sents = corpus.sentences(docs)
    stream: list[int] = []
    while True:
        if rng.random() < cfg.copy_frac:
            s = rng.choice(sents)
            stream += tok.ids(f"{repeat_prompt(s)} {s}\n\n")
        else:
            stream += tok.ids(rng.choice(docs)[:4000] + "\n\n")
        while len(stream) >= cfg.seq_len:
            yield stream[: cfg.seq_len]
            stream = stream[cfg.seq_len:]


def train(model, tok: TextTokenizer, docs: list[str], cfg: TrainConfig, desc: str = "train") -> list[float]:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    stream = _sequences(tok, docs, cfg, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc=desc, mininterval=2)
    for step in bar:
        lr = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.tensor([next(stream) for _ in range(cfg.batch)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


@dataclass
class ZooModel:
    spec: FamilySpec
    model: torch.nn.Module
    tok: TextTokenizer

    @property
    def adapter(self) -> Adapter:
        return registry.adapter_for(self.model, self.spec)

    def set_attn(self, impl: str) -> None:
        self.model.config._attn_implementation = impl
        for m in self.model.modules():
            if hasattr(m, "config") and m.config is not self.model.config:
                m.config._attn_implementation = impl


def save(zm: ZooModel, out: Path, log: dict | None = None) -> None:
    """Write a zoo entry: weights (safetensors, tied head dropped), tokenizer tables, the `FamilySpec` it was
    built from (`spec.json`) and an optional training log."""
    out.mkdir(parents=True, exist_ok=True)
    zm.tok.save(out / "tokenizer")
    save_file({k: v.contiguous() for k, v in zm.model.state_dict().items() if "lm_head" not in k},
              out / "model.safetensors")
    (out / "spec.json").write_text(json.dumps(asdict(zm.spec), indent=1))
    if log is not None:
        (out / "train_log.json").write_text(json.dumps(log))


def load(family: str, root: Path = ROOT, seed: int = 0) -> ZooModel:
    """Load a trained zoo model (never trains). The entry's own `spec.json` wins over the preset when present, so
    a zoo of other sizes (e.g. the tests' tiny pair) loads through the same path."""
    out = Path(root) / "zoo" / family
    registry.family(family)                              # an unknown family is refused by name
    if not (out / "model.safetensors").exists():
        raise FileNotFoundError(f"no zoo model {family!r} under {Path(root) / 'zoo'}: run `heterofold fit` "
                                f"(it trains the zoo on first use)")
    spec = FamilySpec(**json.loads((out / "spec.json").read_text())) if (out / "spec.json").exists() \
        else registry.family(family).spec
    tok = TextTokenizer.load(out / "tokenizer")
    model = spec.build(tok.vocab_size, seed=seed)
    model.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    model.tie_weights()
    return ZooModel(spec, model.eval(), tok)


def trained_steps(family: str, root: Path = ROOT) -> int | None:
    """The optimizer steps an existing zoo model was trained for (None: not trained yet, or no training log)."""
    log = Path(root) / "zoo" / family / "train_log.json"
    if not log.is_file():
        return None
    return json.loads(log.read_text()).get("config", {}).get("steps")


def load_or_train(family: str, root: Path = ROOT, cfg: TrainConfig | None = None) -> ZooModel:
    cfg = cfg or TrainConfig()
    if (root / "zoo" / family / "model.safetensors").exists():
        return load(family, root, cfg.seed)
    spec = registry.family(family).spec
    docs = corpus.build(root / "corpus.json")["train"]
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    tok = TextTokenizer.build(spec.tokenizer, docs[:3000], cfg.vocab_size)
    model = spec.build(tok.vocab_size, seed=cfg.seed)
    losses = train(model, tok, docs, cfg, desc=f"train {family}")
    zm = ZooModel(spec, model, tok)
    save(zm, root / "zoo" / family, {"config": cfg.__dict__, "losses": losses, "seconds": time.time() - t0,
                                     "params": sum(p.numel() for p in model.parameters())})
    return zm


def load_zoo(families=None, root: Path = ROOT) -> dict[str, ZooModel]:
    """The zoo models of `families` (default: the benchmarked ones), trained where missing."""
    families = registry.family_names(benchmarked_only=True) if families is None else families
    return {f: load_or_train(f, root) for f in families}


if __name__ == "__main__":
    load_zoo()
