"""Pretrain a CED preset (the `demo` one by default) on the corpus, on CPU.

    python -m engine_build pretrain --corpus artifacts/corpus --tokenizer artifacts/tokenizer --out artifacts/demo

Rows of `seq_len` tokens are packed from the train split of every domain and mixed by `weights` (general
first); AdamW with linear warmup then cosine decay to `min_lr_ratio`; a fixed seed fixes the initial weights,
the rows and their order. Every `ckpt_every` steps the run writes a checkpoint (weights, AdamW moments and the
loss history, all tensors as safetensors, the rest as JSON); run the same command again to resume from it, with
any `--threads`. Every `eval_every` steps it measures the loss on a fixed mixture of validation rows.

Layout under --out:
    model/                 config.json, model.safetensors, tokenizer.json, tokenizer_config.json (final)
    pretrain/              loss_curve.png, summary.json (config, tokens seen, tokens/s, losses, history)
    pretrain/work/         data.safetensors (the packed rows) and checkpoint/ (removed when the run ends)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor
from tqdm import tqdm

from ced import CEDConfig, CEDForCausalLM

from .corpus import DOMAINS
from .data import mixture_counts, packed_rows
from .tokenizer import load_tokenizer, save_tokenizer
from .train_config import DEFAULT_WEIGHTS, PretrainConfig  # noqa: F401 - importable from here too



# -- data ------------------------------------------------------------------------------------------------------

@dataclass
class PretrainData:
    train: Tensor  # (N, seq_len) int64, already in training order
    valid: dict[str, Tensor]  # domain -> (n, seq_len)


def _data_key(cfg: PretrainConfig, corpus_dir: Path, tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for part in (json.dumps([cfg.tokens, cfg.seq_len, cfg.batch_size, cfg.seed, cfg.weights, cfg.valid_rows],
                            sort_keys=True).encode(),
                 (corpus_dir / "manifest.json").read_bytes() if (corpus_dir / "manifest.json").exists() else b"",
                 (tokenizer_dir / "tokenizer.json").read_bytes()):
        h.update(part)
    return h.hexdigest()[:16]


def build_data(cfg: PretrainConfig, corpus_dir: str | Path, tokenizer_dir: str | Path, cache: Path | None = None,
               progress: bool = True) -> PretrainData:
    """The packed train rows (in order) and validation rows; cached in `cache` (safetensors) when given."""
    corpus_dir, tokenizer_dir = Path(corpus_dir), Path(tokenizer_dir)
    key = _data_key(cfg, corpus_dir, tokenizer_dir)
    if cache is not None and cache.exists():
        tensors = load_file(str(cache))
        if tensors["key"].tolist() == list(key.encode()):
            return PretrainData(tensors["train"].long(),
                                {d: tensors[f"valid.{d}"].long() for d in DOMAINS if f"valid.{d}" in tensors})
    tokenizer = load_tokenizer(tokenizer_dir)
    train_counts = mixture_counts(cfg.steps * cfg.batch_size, cfg.weights)
    valid_counts = mixture_counts(cfg.valid_rows, cfg.weights)
    train, valid = [], {}
    for domain in tqdm(list(cfg.weights), desc="tokenizing the corpus", disable=not progress):
        rows = packed_rows(corpus_dir, domain, "train", tokenizer, cfg.seq_len, train_counts[domain], cfg.seed,
                           progress)
        if len(rows) < train_counts[domain]:  # a small domain: cycle its rows rather than change the mixture
            rows = rows.repeat(math.ceil(train_counts[domain] / max(1, len(rows))), 1)[: train_counts[domain]]
        train.append(rows)
        valid[domain] = packed_rows(corpus_dir, domain, "valid", tokenizer, cfg.seq_len, max(1, valid_counts[domain]),
                                    cfg.seed)
    train = torch.cat(train)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    data = PretrainData(train[order], valid)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"train": data.train.int(), "key": torch.tensor(list(key.encode()), dtype=torch.uint8)}
        tensors.update({f"valid.{d}": rows.int() for d, rows in valid.items()})
        save_file(tensors, str(cache))
    return data


# -- model, optimizer, checkpoints -----------------------------------------------------------------------------

def make_optimizer(model: torch.nn.Module, cfg: PretrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                             foreach=False)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    elapsed: float = 0.0  # training seconds over all sessions (evaluation excluded)
    train_loss: list[float] = field(default_factory=list)  # one per step
    valid: list[dict] = field(default_factory=list)  # {"step", "tokens", "loss", "per_domain"}


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                    cfg: PretrainConfig) -> None:
    """Write weights, AdamW moments (safetensors) and the rest (JSON) to a fresh folder, then swap it in."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    moments = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            moments[f"{name}::{key}"] = value.detach().clone().reshape(value.shape)
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"config": cfg.to_dict(), **dataclasses.asdict(state)}) + "\n")
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    cfg: PretrainConfig) -> TrainState:
    saved = json.loads((path / "state.json").read_text())
    theirs = saved.pop("config")
    ours = json.loads(json.dumps(cfg.to_dict()))
    if theirs != ours:
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise ValueError(f"{path} was written by a run with other settings ({differ}); remove it or pass them again")
    missing, unexpected = load_model(model, str(path / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint weights do not match the model ({missing=}, {unexpected=})")
    moments = load_file(str(path / "optimizer.safetensors"))
    for name, param in model.named_parameters():
        entry = {key.split("::", 1)[1]: value for key, value in moments.items() if key.split("::", 1)[0] == name}
        if entry:
            optimizer.state[param] = entry
    return TrainState(**saved)


# -- evaluation ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: Tensor, batch_size: int, bf16: bool, chunk_size: int = 256) -> float:
    """Mean next-token loss over rows (N, T) (every row has T-1 targets, so the mean of batch means is exact)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch, labels=batch, chunk_size=chunk_size).loss
        total, count = total + float(loss) * len(batch), count + len(batch)
    model.train(was_training)
    return total / max(1, count)


def validation(model, data: PretrainData, cfg: PretrainConfig) -> tuple[float, dict[str, float]]:
    per_domain = {d: evaluate(model, rows, cfg.batch_size, cfg.bf16, cfg.chunk_size)
                  for d, rows in data.valid.items() if len(rows)}
    n = {d: len(data.valid[d]) for d in per_domain}
    return sum(per_domain[d] * n[d] for d in per_domain) / sum(n.values()), per_domain


# -- the run ---------------------------------------------------------------------------------------------------

def plot_losses(state: TrainState, cfg: PretrainConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [(i + 1) * cfg.tokens_per_step / 1e6 for i in range(len(state.train_loss))]
    smooth, ema = [], None
    for loss in state.train_loss:
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tokens, state.train_loss, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(tokens, smooth, color="tab:blue", label="train (EMA 0.95)")
    if state.valid:
        ax.plot([v["tokens"] / 1e6 for v in state.valid], [v["loss"] for v in state.valid], "o-",
                color="tab:orange", label="validation")
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"CED '{cfg.preset}' pretraining: {cfg.steps} steps x {cfg.tokens_per_step} tokens")
    low = min(smooth + [v["loss"] for v in state.valid]) if smooth else 0
    ax.set_ylim(max(0.0, low - 0.3), low + 4.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pretrain(cfg: PretrainConfig, corpus_dir: str | Path, tokenizer_dir: str | Path, out: str | Path,
             progress: bool = True, keep_work: bool = False, stop_after: int | None = None) -> dict:
    """Train (resuming from out/pretrain/work/checkpoint when present) and save out/model. Returns the summary.

    `stop_after`: stop after that many steps of this session with a checkpoint (tests; an interrupted run).
    """
    out = Path(out)
    report_dir, work = out / "pretrain", out / "pretrain" / "work"
    checkpoint = work / "checkpoint"
    data = build_data(cfg, corpus_dir, tokenizer_dir, work / "data.safetensors", progress)
    # The embedding is sized to the tokenizer (the preset's vocab_size is the default tokenizer's), so a tokenizer
    # trained with another --vocab-size works instead of failing inside the first forward.
    config = replace(CEDConfig.from_name(cfg.preset), vocab_size=load_tokenizer(tokenizer_dir).get_vocab_size())
    model = CEDForCausalLM.from_ced(config, seed=cfg.seed).float().train()
    optimizer = make_optimizer(model, cfg)
    state = load_checkpoint(checkpoint, model, optimizer, cfg) if checkpoint.exists() else TrainState()
    if state.step:
        tqdm.write(f"resumed from {checkpoint} at step {state.step}/{cfg.steps}")
    n_params = sum(p.numel() for p in model.parameters())

    def log_validation():
        loss, per_domain = validation(model, data, cfg)
        state.valid.append({"step": state.step, "tokens": state.step * cfg.tokens_per_step, "loss": loss,
                            "per_domain": per_domain})
        tqdm.write(f"step {state.step:>5}  tokens {state.step * cfg.tokens_per_step / 1e6:7.2f}M  valid {loss:.4f}  "
                   + "  ".join(f"{d} {v:.3f}" for d, v in per_domain.items()))

    if not state.valid:
        log_validation()
    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"pretrain {cfg.preset} ({n_params / 1e6:.1f}M)",
               unit="step", disable=not progress, mininterval=5)
    session_start, session_steps = time.perf_counter(), 0
    while state.step < cfg.steps and (stop_after is None or session_steps < stop_after):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(state.step)
        batch = data.train[state.step * cfg.batch_size: (state.step + 1) * cfg.batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(batch, labels=batch, chunk_size=cfg.chunk_size).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step, session_steps = state.step + 1, session_steps + 1
        state.elapsed += time.perf_counter() - started
        loss = loss.detach()
        state.train_loss.append(float(loss))
        bar.update()
        session_rate = session_steps * cfg.tokens_per_step / (time.perf_counter() - session_start)
        bar.set_postfix(loss=f"{float(loss):.3f}", lr=f"{cfg.lr_at(state.step - 1):.2e}", tok_s=f"{session_rate:.0f}")
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            log_validation()
        if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps:
            save_checkpoint(checkpoint, model, optimizer, state, cfg)
    bar.close()
    if state.step < cfg.steps:
        save_checkpoint(checkpoint, model, optimizer, state, cfg)
        return {"finished": False, "step": state.step}

    model.save_pretrained(out / "model")
    save_tokenizer(load_tokenizer(tokenizer_dir), out / "model")
    report_dir.mkdir(parents=True, exist_ok=True)
    plot_losses(state, cfg, report_dir / "loss_curve.png")
    tail = state.train_loss[-max(1, cfg.eval_every):]
    summary = {
        "finished": True, "config": cfg.to_dict(), "parameters": n_params, "steps": state.step,
        "tokens_seen": state.step * cfg.tokens_per_step, "train_seconds": state.elapsed,
        "tokens_per_second": state.step * cfg.tokens_per_step / max(state.elapsed, 1e-9),
        "final_train_loss": sum(tail) / len(tail), "final_valid_loss": state.valid[-1]["loss"],
        "final_valid_per_domain": state.valid[-1]["per_domain"], "history": dataclasses.asdict(state),
    }
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return summary
