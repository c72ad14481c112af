"""Train the demo's LoRA adapters with PEFT on the pretrained base, check them against the engine, print the table.

    python -m engine_build adapters --corpus artifacts/corpus --model artifacts/demo/model --out artifacts/demo/adapters

| adapter        | data                 | modules                                                  | CEDEngine |
|----------------|----------------------|----------------------------------------------------------|-----------|
| chat, agent,   | that domain's train  | attention + FFN of decoder layers E+1..L-1, and layer    | loads     |
| coding, design | split                | E's FFN (the decoder-only placement); r=16, alpha=32     |           |
| every_layer    | `every_layer_domain` | attention + FFN of every layer, encoder included; r=16   | refused   |
| random_l0      | none (random A, B)   | attn.o_proj, mlp.up_proj, mlp.down_proj of the decoder;  | loads     |
|                |                      | r=8                                                      |           |

Records are tokenized as in pretraining (`engine_build.data`: chat layout for records with turns, loss on every
token), each cut to one random window of `max_doc_tokens` tokens so that the rows cover many documents. Each
trained adapter is scored on its domain's validation split, base against adapter, in float32; then loaded into
`ced.CEDEngine` (the placement check) and its engine logits compared with PEFT's own forward.
Output: one PEFT folder per adapter (adapter_config.json, adapter_model.safetensors, description.txt) and
adapters.md / adapters.json with the table.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor
from tqdm import tqdm

from ced import CEDEngine, CEDForCausalLM, PlacementError
from ced.baseline import EveryLayerBaseline
from ced.demo import ADAPTERS
from ced.synthetic import ATTENTION, FFN, decoder_modules_regex, make_random_adapter

from .data import packed_rows
from .tokenizer import load_tokenizer
from .train_config import AdapterTrainConfig

RANDOM_L0_MODULES = ("attn.o_proj", "mlp.up_proj", "mlp.down_proj")
EVERY_LAYER_DESCRIPTION = "every-layer LoRA (encoder included) for the baseline; refused by the CED engine"
RANDOM_L0_DESCRIPTION = "randomly initialised LoRA on another module set (the seed's L0); not trained"


def every_layer_regex(n_layers: int, modules: tuple[str, ...] = ATTENTION + FFN) -> str:
    names = "|".join(m.replace(".", r"\.") for m in modules)
    return rf"model\.layers\.({'|'.join(map(str, range(n_layers)))})\.({names})"


@torch.no_grad()
def mean_loss(model: torch.nn.Module, rows: Tensor, batch_size: int, chunk_size: int = 128) -> float:
    """Mean next-token loss (float32) over rows (N, T); every row has T-1 targets."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows[start: start + batch_size]
        total += float(model(input_ids=batch, labels=batch, chunk_size=chunk_size).loss) * len(batch)
    model.train(was_training)
    return total / max(1, len(rows))


def train_lora(base: CEDForCausalLM, rows: Tensor, target_modules: str, cfg: AdapterTrainConfig,
               desc: str = "adapter", progress: bool = True):
    """A PEFT LoRA on a deep copy of `base`, trained on rows (N, T) in order (cycled if N < steps * batch)."""
    torch.manual_seed(cfg.seed)
    model = get_peft_model(copy.deepcopy(base).float(),
                           LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=target_modules,
                                      lora_dropout=0.0, bias="none"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    model.train()
    losses = []
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, mininterval=5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        index = torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % len(rows)
        batch = rows[index]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=batch, labels=batch, chunk_size=cfg.chunk_size).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return model, losses


def engine_logit_gap(base: CEDForCausalLM, adapter_dir: Path, peft_model, tokens: Tensor, max_rank: int = 16) -> float:
    """Max |engine logits - PEFT logits| over tokens (1, T) with the adapter loaded into CEDEngine's slots."""
    engine = CEDEngine(copy.deepcopy(base), max_adapters=2, max_rank=max_rank)
    engine.adapters.load("x", adapter_dir)
    ours = engine.forward_batch(tokens, ["x"])
    with torch.no_grad():
        theirs = peft_model(input_ids=tokens, chunk_size=engine.prefill_chunk).logits
    return float((ours - theirs).abs().max())


def _write_table(rows: list[dict], out: Path, meta: dict) -> str:
    header = ("| adapter | data | modules | base valid loss | adapter valid loss | change | valid tokens | "
              "engine load | max abs logit diff (engine vs PEFT) |")
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        base_loss = f"{r['base_valid_loss']:.4f}" if r["base_valid_loss"] is not None else "-"
        ada_loss = f"{r['adapter_valid_loss']:.4f}" if r["adapter_valid_loss"] is not None else "-"
        change = f"{r['adapter_valid_loss'] - r['base_valid_loss']:+.4f}" if r["base_valid_loss"] is not None else "-"
        gap = f"{r['engine_logit_gap']:.2e}" if r["engine_logit_gap"] is not None else "-"
        lines.append(f"| {r['name']} | {r['domain'] or '-'} | {r['modules']} | {base_loss} | {ada_loss} | {change} | "
                     f"{r['valid_tokens']} | {r['engine']} | {gap} |")
    table = "\n".join(lines)
    body = (f"# Demo adapters\n\nBase: `{meta['model']}`. Trained with PEFT: {json.dumps(meta['config'])}.\n"
            "Validation loss: mean next-token cross-entropy (nats/token, float32) on the domain's validation split "
            "(packed 512-token rows, loss on every token).\n\n" + table + "\n")
    (out / "adapters.md").write_text(body)
    (out / "adapters.json").write_text(json.dumps({**meta, "adapters": rows}, indent=1) + "\n")
    return table


def train_adapters(corpus_dir: str | Path, model_dir: str | Path, out: str | Path,
                   cfg: AdapterTrainConfig | None = None, progress: bool = True) -> list[dict]:
    cfg = cfg or AdapterTrainConfig()
    out, model_dir = Path(out), Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = CEDForCausalLM.from_pretrained(model_dir).float().eval()
    config, tokenizer = base.ced, load_tokenizer(model_dir)
    decoder_targets = decoder_modules_regex(config, ATTENTION + FFN)
    plan = [(name, name, decoder_targets, ADAPTERS[name]) for name in ADAPTERS]
    plan.append(("every_layer", cfg.every_layer_domain, every_layer_regex(config.n_layers), EVERY_LAYER_DESCRIPTION))

    max_rank = max(16, cfg.rank, cfg.random_rank)  # the checks load each adapter into an engine of this many ranks
    valid_cache: dict[str, Tensor] = {}
    for domain in dict.fromkeys(domain for _, domain, _, _ in plan):  # all before any training
        valid_cache[domain] = packed_rows(corpus_dir, domain, "valid", tokenizer, cfg.seq_len, cfg.valid_rows,
                                          seed=cfg.seed, max_doc_tokens=cfg.max_doc_tokens)
        if len(valid_cache[domain]) == 0:  # the losses and the engine check need at least one row
            raise ValueError(f"{corpus_dir}: {domain}.valid packs into no {cfg.seq_len}-token row; build a larger "
                             "corpus (python -m engine_build corpus --scale ...) or lower --seq-len")
    base_loss = {domain: mean_loss(base, valid, cfg.batch_size, cfg.chunk_size) for domain, valid in valid_cache.items()}
    rows = []
    for name, domain, targets, description in plan:
        started = time.perf_counter()
        train = packed_rows(corpus_dir, domain, "train", tokenizer, cfg.seq_len, cfg.steps * cfg.batch_size,
                            seed=cfg.seed + 1, max_doc_tokens=cfg.max_doc_tokens)
        valid = valid_cache[domain]
        model, losses = train_lora(base, train, targets, cfg, desc=f"adapter {name}", progress=progress)
        path = out / name
        model.save_pretrained(str(path))
        (path / "description.txt").write_text(description + "\n")
        adapter_loss = mean_loss(model, valid, cfg.batch_size, cfg.chunk_size)
        engine, gap = "loads", None
        try:
            gap = engine_logit_gap(base, path, model, valid[:1, :256], max_rank)
        except PlacementError as error:
            engine = "refused (expected)" if name == "every_layer" else f"REFUSED: {error}"
            if name == "every_layer":  # the baseline takes it
                baseline = EveryLayerBaseline(copy.deepcopy(base), max_adapters=2, max_rank=max_rank)
                baseline.adapters.load("x", path)
                engine += "; EveryLayerBaseline loads"
        if name == "every_layer" and engine == "loads":
            engine = "LOADED (expected a refusal)"
        rows.append({"name": name, "domain": domain, "description": description,
                     "modules": "every layer, attn+ffn" if name == "every_layer" else "decoder, attn+ffn",
                     "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                     "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "train_rows_available": len(train),
                     "train_loss_first": losses[0], "train_loss_last": sum(losses[-5:]) / len(losses[-5:]),
                     "base_valid_loss": base_loss[domain], "adapter_valid_loss": adapter_loss,
                     "valid_tokens": int(valid.numel()), "lower_than_base": adapter_loss < base_loss[domain],
                     "engine": engine, "engine_logit_gap": gap, "seconds": time.perf_counter() - started})
        tqdm.write(f"{name}: base {base_loss[domain]:.4f} -> adapter {adapter_loss:.4f} on {domain}.valid; "
                   f"engine {engine}")

    path = out / "random_l0"
    make_random_adapter(base, path, decoder_modules_regex(config, RANDOM_L0_MODULES), rank=cfg.random_rank,
                        alpha=2 * cfg.random_rank, seed=cfg.seed + 100, scale=cfg.random_scale)
    (path / "description.txt").write_text(RANDOM_L0_DESCRIPTION + "\n")
    engine = CEDEngine(copy.deepcopy(base), max_adapters=2, max_rank=max_rank)
    engine.adapters.load("random_l0", path)
    general = packed_rows(corpus_dir, "general", "valid", tokenizer, cfg.seq_len, cfg.valid_rows // 2, seed=cfg.seed,
                          max_doc_tokens=cfg.max_doc_tokens)
    with torch.no_grad():
        random_loss = sum(float(torch.nn.functional.cross_entropy(
            engine.forward_batch(row[None], ["random_l0"])[0, :-1], row[1:])) for row in general) / len(general)
    rows.append({"name": "random_l0", "domain": "general", "description": RANDOM_L0_DESCRIPTION,
                 "modules": "decoder, o_proj+up_proj+down_proj, r=8", "trainable_parameters": 0,
                 "base_valid_loss": mean_loss(base, general, cfg.batch_size, cfg.chunk_size),
                 "adapter_valid_loss": random_loss, "valid_tokens": int(general.numel()), "lower_than_base": None,
                 "engine": "loads", "engine_logit_gap": None})
    meta = {"model": str(model_dir), "config": cfg.to_dict()}
    table = _write_table(rows, out, meta)
    print(table)
    return rows
