"""Pretrain the DeepSeek-V4.1-layout demo (preset `v41-demo`) on the demo corpus, on CPU: the CED demo's recipe
(engine_build/pretrain.py: the same packed rows, mixture, AdamW with warmup and cosine decay, checkpoints, resume)
on `DeepseekV41ForCausalLM`'s differentiable `hidden`.

What differs from the CED demo, and why:
- float32 throughout, no bf16 autocast: autocast would run the indexer's scores in bf16, and its exact top-k
  (`ced.model.top_k_recent`) reads scores as float32 bits.
- The routed experts are balanced as DeepSeek-V3 does without an auxiliary loss (`noaux_tc`): after every step
  each gate's selection-only bias moves by `GateBalancer.speed` towards the experts chosen less than average.
- The indexer (queries, keys, weights) only chooses entries by top-k, so the language-model loss gives it no
  gradient: it keeps its seeded initial weights (DeepSeek trains it with a separate distillation loss, not built
  here). The attention learns to use the entries it picks.

Layout under OUT (ROOT/demo-v41):
    master/weights.safetensors     the float32 weights under native names (quantized and published by the next stage)
    pretrain/summary.json, loss_curve.png
    pretrain/work/                 packed rows and the resumable checkpoint (removed when the run ends)
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.model import DeepseekV41ForCausalLM, Gate

from .pretrain import (
    PretrainData,
    TrainState,
    build_data,
    load_checkpoint,
    make_optimizer,
    plot_losses,
    save_checkpoint,
)
from .tokenizer import load_tokenizer
from .train_config import PretrainConfig


def model_config(preset: str, tokenizer_dir: str | Path) -> V41Config:
    """The preset with its embedding sized to the tokenizer (as the CED demo's pretraining does)."""
    return V41Config.from_name(preset, vocab_size=load_tokenizer(tokenizer_dir).get_vocab_size())


def lm_loss(model: DeepseekV41ForCausalLM, rows: Tensor, chunk_size: int) -> Tensor:
    """Mean next-token cross-entropy over rows (B, T), differentiable."""
    logits = model.logits(model.hidden(rows, chunk_size))  # (B, T, V) float32
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model: DeepseekV41ForCausalLM, rows: Tensor, batch_size: int, chunk_size: int) -> float:
    """Mean next-token loss over rows (N, T) (every row has T-1 targets, so the mean of batch means is exact)."""
    total = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        total += float(lm_loss(model, batch, chunk_size)) * len(batch)
    return total / max(1, len(rows))


def validation(model, data: PretrainData, cfg: PretrainConfig) -> tuple[float, dict[str, float]]:
    per_domain = {d: mean_loss(model, rows, cfg.batch_size, cfg.chunk_size) for d, rows in data.valid.items()
                  if len(rows)}
    n = {d: len(data.valid[d]) for d in per_domain}
    return sum(per_domain[d] * n[d] for d in per_domain) / sum(n.values()), per_domain


class GateBalancer:
    """Auxiliary-loss-free expert balancing (DeepSeek-V3 §2.1.2), attached from outside the model: forward hooks
    count the experts each gate picks; `step()` then moves every gate's bias by `speed` towards the experts picked
    less than the layer's average and returns the worst layer's max/mean load (1.0 = perfectly even)."""

    speed = 1e-3  # DeepSeek-V3's bias update speed (gamma)

    def __init__(self, model: DeepseekV41ForCausalLM):
        self.counts: dict[Gate, Tensor] = {}
        self.handles = [gate.register_forward_hook(self._count) for gate in model.modules() if isinstance(gate, Gate)]

    def _count(self, gate: Gate, inputs, output) -> None:
        picked = torch.bincount(output[0].flatten(), minlength=gate.config.n_routed_experts)
        self.counts[gate] = self.counts.get(gate, 0) + picked

    def reset(self) -> None:
        self.counts.clear()

    @torch.no_grad()
    def step(self) -> float:
        worst = 1.0
        for gate, count in self.counts.items():
            load = count.float()
            gate.bias += self.speed * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp(min=1e-9)))
        self.counts.clear()
        return worst

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def pretrain_v41(cfg: PretrainConfig, corpus_dir: str | Path, tokenizer_dir: str | Path, out: str | Path,
                 progress: bool = True, stop_after: int | None = None) -> dict:
    """Train (resuming from OUT/pretrain/work/checkpoint when present); write OUT/pretrain. Returns the summary
    ({"finished": False, "step": n} when `stop_after` stopped it first)."""
    out = Path(out)
    report_dir, work = out / "pretrain", out / "pretrain" / "work"
    checkpoint = work / "checkpoint"
    data = build_data(cfg, corpus_dir, tokenizer_dir, work / "data.safetensors", progress)
    config = model_config(cfg.preset, tokenizer_dir)
    model = DeepseekV41ForCausalLM.from_config(config, seed=cfg.seed).float().train()
    optimizer = make_optimizer(model, cfg)
    state = load_checkpoint(checkpoint, model, optimizer, cfg) if checkpoint.exists() else TrainState()
    if state.step:
        tqdm.write(f"resumed from {checkpoint} at step {state.step}/{cfg.steps}")
    n_params = sum(p.numel() for p in model.parameters())
    balancer = GateBalancer(model)

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
        balancer.reset()  # count this step's choices only (validation runs the gates too)
        loss = lm_loss(model, batch, cfg.chunk_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        state.step, session_steps = state.step + 1, session_steps + 1
        state.elapsed += time.perf_counter() - started
        state.train_loss.append(float(loss.detach()))
        bar.update()
        rate = session_steps * cfg.tokens_per_step / (time.perf_counter() - session_start)
        bar.set_postfix(loss=f"{state.train_loss[-1]:.3f}", lr=f"{cfg.lr_at(state.step - 1):.2e}", tok_s=f"{rate:.0f}",
                        load=f"{imbalance:.2f}")
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            log_validation()
        if state.step % cfg.ckpt_every == 0 or state.step == cfg.steps:
            save_checkpoint(checkpoint, model, optimizer, state, cfg)
    bar.close()
    balancer.remove()
    if state.step < cfg.steps:
        save_checkpoint(checkpoint, model, optimizer, state, cfg)
        return {"finished": False, "step": state.step}

    report_dir.mkdir(parents=True, exist_ok=True)
    (out / "master").mkdir(parents=True, exist_ok=True)
    weights = {name: value.detach().contiguous() for name, value in model.state_dict().items()}
    save_file(weights, str(out / "master" / "weights.safetensors"), metadata={"config": json.dumps(config.to_hf())})
    plot_losses(state, cfg, report_dir / "loss_curve.png")
    tail = state.train_loss[-max(1, cfg.eval_every):]
    summary = {
        "finished": True, "config": cfg.to_dict(), "model": config.to_hf(), "parameters": n_params,
        "steps": state.step, "tokens_seen": state.step * cfg.tokens_per_step, "train_seconds": state.elapsed,
        "tokens_per_second": state.step * cfg.tokens_per_step / max(state.elapsed, 1e-9),
        "final_train_loss": sum(tail) / len(tail), "final_valid_loss": state.valid[-1]["loss"],
        "final_valid_per_domain": state.valid[-1]["per_domain"], "history": dataclasses.asdict(state),
    }
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return summary
