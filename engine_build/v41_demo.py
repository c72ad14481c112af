"""`mol2 build demo --family deepseek_v41`: the DeepSeek-V4.1-layout demo, built the way the CED demo is.

Stages under ROOT/demo-v41 (ROOT/demo-v41-quick with --quick), each skipped when its output exists; pretraining
resumes from its last checkpoint:

    pretrain   master/weights.safetensors (float32), pretrain/: preset `v41-demo` on the demo corpus
               (engine_build/v41_pretrain.py)
    quantize   quantization.json, model/: the validation loss of the weights as each storage keeps them (float32,
               BF16, FP8 everywhere, the release's FP8 + FP4 experts); model/ written in the release's format
               (ced/deepseek_v41/checkpoint.py) when that storage stays within 1 % of float32, with the tokenizer
    adapters   adapters/<name>/, adapters/adapters.json: chat / agent / coding / design LoRA trained with PEFT on
               the native names, on the published weights, each scored against the base and loaded into
               `V41AdapterSet`; plus random_l0, random A and B on every adaptable module (routed experts included)
    router     (`mol2 router demo-v41`, mol2_router/demo_v41.py: the router sits above the build) router/,
               router/accuracy.json: the MoL2 head (mode B, seed 0) on H19 pooled over the mHC streams
    (always)   manifest.json, README.md, adapter_set.json: the numbers and the file sizes

The corpus is ROOT/corpus (built by the CED demo's corpus stage when missing); the tokenizer is the committed
demo's (models/demo/model), so both demos share one vocabulary, else ROOT/tokenizer.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ced.deepseek_v41 import checkpoint as ckpt
from ced.deepseek_v41.adapters import V41AdapterSet, placement_violation
from ced.deepseek_v41.config import V41Config
from ced.deepseek_v41.model import DeepseekV41ForCausalLM
from ced.demo import ADAPTERS, COMMITTED

from .data import packed_rows
from .pretrain import build_data
from .tokenizer import load_tokenizer, save_tokenizer
from .train_config import AdapterTrainConfig, PretrainConfig
from .v41_pretrain import lm_loss, mean_loss, pretrain_v41

LOSS_BUDGET = 0.01  # a storage is published only if it keeps the validation loss within 1 % of float32
SHARD_BYTES = 2 * 2**20  # several shards, as the release has (48 of ~10 GB)
PEFT_ATTENTION = ("wq_a", "wq_b", "wkv", "wo_b")  # wo_a is grouped: PEFT's Linear LoRA would mix its groups
SHARED_EXPERT = ("w1", "w2", "w3")
RANDOM_DESCRIPTION = "random A and B on every adaptable module, routed experts included (the seed's L0); not trained"


@dataclass
class V41DemoSettings:
    """Everything a build depends on; FULL is the published demo, QUICK a few-minute build for tests."""

    pretrain: PretrainConfig
    adapters: AdapterTrainConfig
    router_epochs: int = 30  # per stage, mol2_router's default
    router_limits: dict[str, int] = field(default_factory=dict)  # questions kept per split (none: all)
    random_rank: int = 8
    random_scale: float = 0.05  # random_l0's A, B ~ N(0, scale^2)


FULL = V41DemoSettings(  # sized for a shared 2-core machine: ~330K pretraining tokens (the CED demo saw 1.6M)
    PretrainConfig(preset="v41-demo", tokens=327_680, seq_len=512, batch_size=4, lr=2e-3, warmup_steps=16,
                   eval_every=40, ckpt_every=20, valid_rows=20, bf16=False, chunk_size=512),
    AdapterTrainConfig(rank=16, alpha=32.0, lr=2e-3, steps=30, warmup_steps=3, batch_size=2, seq_len=512,
                       valid_rows=8, bf16=False, chunk_size=512),
    router_limits={"generic.train": 2400, "generic.dev": 300, "generic.test": 300})
QUICK = V41DemoSettings(
    PretrainConfig(preset="v41-tiny", tokens=8 * 2 * 64, seq_len=64, batch_size=2, lr=2e-3, warmup_steps=2,
                   eval_every=4, ckpt_every=4, valid_rows=5, bf16=False, chunk_size=64),
    AdapterTrainConfig(rank=4, alpha=8.0, lr=2e-3, steps=3, warmup_steps=1, batch_size=2, seq_len=64, valid_rows=2,
                       bf16=False, chunk_size=64, max_doc_tokens=256),
    router_epochs=2, router_limits={"generic.train": 200, "generic.dev": 50, "generic.test": 50, "domain.train": 100,
                                    "domain.dev": 40, "domain.bench": 80})


def demo_tokenizer(root: Path) -> Path:
    """The committed CED demo's tokenizer folder, else ROOT/tokenizer."""
    return COMMITTED / "model" if (COMMITTED / "model" / "tokenizer.json").is_file() else root / "tokenizer"


# -- quantize: what each storage costs, and the published model -------------------------------------------------

def stored_as(state: dict, variant: str) -> dict:
    """Each weight as `variant` keeps it, back in float32. "release": checkpoint.py's rule (FP8 dense, FP4 routed
    experts, BF16 and F32 where the release has them); "fp8": routed experts in FP8 too; "bf16": no FP8 or FP4."""
    out = {}
    for name, value in state.items():
        storage = ckpt.storage_for(name)
        if variant == "float32":
            storage = ckpt.F32
        elif variant == "bf16" and storage.kind in ("fp8", "fp4"):
            storage = ckpt.BF16
        elif variant == "fp8" and storage.kind == "fp4":
            storage = ckpt.FP8
        out[name] = storage.decode(name, storage.encode(name, value), torch.float32)
    return out


def payload_bytes(state: dict, variant: str) -> int:
    sizes = {"float32": 4, "bf16": 2}
    if variant in sizes:
        return sum(v.numel() * (4 if ckpt.storage_for(n).kind == "f32" else sizes[variant]) for n, v in state.items())
    return sum(t.numel() * t.element_size() for t in stored_as_files(state, variant).values())


def stored_as_files(state: dict, variant: str) -> dict:
    files = {}
    for name, value in state.items():
        storage = ckpt.storage_for(name)
        if variant == "fp8" and storage.kind == "fp4":
            storage = ckpt.FP8
        files.update(storage.encode(name, value))
    return files


def quantize_stage(settings: V41DemoSettings, corpus: Path, tokenizer_dir: Path, out: Path, progress: bool) -> dict:
    """Measure every storage on the pretraining's validation rows; publish model/ in the release's storage when it
    keeps the loss within LOSS_BUDGET (else stop and say which storages would)."""
    cfg = settings.pretrain
    state = load_file(str(out / "master" / "weights.safetensors"))
    config = V41Config.from_hf(json.loads((out / "pretrain" / "summary.json").read_text())["model"])
    data = build_data(cfg, corpus, tokenizer_dir, None, progress=False)
    valid = torch.cat([rows for rows in data.valid.values() if len(rows)])
    model = DeepseekV41ForCausalLM(config).eval()
    rows = []
    for variant in tqdm(("float32", "bf16", "fp8", "release"), desc="quantize: validation loss per storage",
                        disable=not progress):
        model.load_state_dict(stored_as(state, variant))
        rows.append({"storage": variant, "valid_loss": mean_loss(model, valid, cfg.batch_size, cfg.chunk_size),
                     "payload_bytes": payload_bytes(state, variant)})
    for row in rows:
        row["change"] = row["valid_loss"] / rows[0]["valid_loss"] - 1
        row["within_budget"] = abs(row["change"]) <= LOSS_BUDGET
    report = {"budget": LOSS_BUDGET, "valid_tokens": int(valid.numel()), "rows": rows}
    release = rows[-1]
    if not release["within_budget"]:
        (out / "quantization.json").write_text(json.dumps(report, indent=1) + "\n")
        raise ValueError(f"the release's storage changes the validation loss by {release['change']:+.2%}, over "
                         f"{LOSS_BUDGET:.0%}: see {out / 'quantization.json'}")
    summary = ckpt.write_checkpoint(out / "model", config, state, SHARD_BYTES)
    save_tokenizer(load_tokenizer(tokenizer_dir), out / "model")
    _, published = ckpt.load_checkpoint(out / "model")  # read back through the loader the engine uses
    report.update(published="release", shards=summary.shards, published_payload_bytes=summary.payload_bytes,
                  published_valid_loss=mean_loss(published, valid, cfg.batch_size, cfg.chunk_size))
    (out / "quantization.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


# -- adapters ---------------------------------------------------------------------------------------------------

def adapter_targets(config: V41Config) -> str:
    """PEFT's target_modules (a regex on native names): attention of layers E+1..L-1 and the shared expert of
    layers E..L-1, every one allowed by the placement rule."""
    E, L = config.decoder_start, config.num_hidden_layers
    upper, decoder = "|".join(map(str, range(E + 1, L))), "|".join(map(str, range(E, L)))
    return (rf"layers\.({upper})\.attn\.({'|'.join(PEFT_ATTENTION)})"
            rf"|layers\.({decoder})\.ffn\.shared_experts\.({'|'.join(SHARED_EXPERT)})")


def train_adapter(base: DeepseekV41ForCausalLM, rows: torch.Tensor, cfg: AdapterTrainConfig, desc: str,
                  progress: bool):
    """A PEFT LoRA on a copy of `base`, trained on rows (N, T) in order (cycled); returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                                                           target_modules=adapter_targets(base.config), bias="none"))
    inner = model.get_base_model()  # PEFT injected the LoRA layers in place: the model's own methods use them
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    losses = []
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress, mininterval=5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch = rows[torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size) % len(rows)]
        loss = lm_loss(inner, batch, cfg.chunk_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return model.eval(), losses


@torch.no_grad()
def engine_gap(base: DeepseekV41ForCausalLM, name: str, path: Path, reference, tokens: torch.Tensor) -> float:
    """Max |logits| difference between the adapter loaded by the engine's V41AdapterSet and `reference` (a model
    whose forward gives the same adapter's logits; None: the base)."""
    adapters = V41AdapterSet(copy.deepcopy(base))
    adapters.load(name, path)
    adapters.use(name)
    return float((adapters.model(tokens) - reference(tokens)).abs().max())


def write_random_adapter(base: DeepseekV41ForCausalLM, path: Path, rank: int, scale: float, seed: int) -> int:
    """random_l0: random (A, B) on every module V41AdapterSet wraps (attention, shared and routed experts)."""
    from ced.adapters import write_peft_adapter

    modules = V41AdapterSet(copy.deepcopy(base)).modules
    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(rank, m.in_features, generator=g) * scale,
                      torch.randn(m.out_features, rank, generator=g) * scale) for name, m in modules.items()}
    write_peft_adapter(path, weights, r=rank, lora_alpha=2 * rank, base_model="demo-v41")
    (path / "description.txt").write_text(RANDOM_DESCRIPTION + "\n")
    return len(weights)


def adapters_stage(settings: V41DemoSettings, corpus: Path, out: Path, progress: bool) -> list[dict]:
    cfg = settings.adapters
    config, base = ckpt.load_checkpoint(out / "model")
    tokenizer = load_tokenizer(out / "model")
    adapters_dir = out / "adapters"
    adapters_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, description in ADAPTERS.items():
        started = time.perf_counter()
        train = packed_rows(corpus, name, "train", tokenizer, cfg.seq_len, cfg.steps * cfg.batch_size,
                            seed=cfg.seed + 1, max_doc_tokens=cfg.max_doc_tokens)
        valid = packed_rows(corpus, name, "valid", tokenizer, cfg.seq_len, cfg.valid_rows, seed=cfg.seed,
                            max_doc_tokens=cfg.max_doc_tokens)
        if not len(train) or not len(valid):
            raise ValueError(f"{corpus}: {name} packs into no {cfg.seq_len}-token row; build a larger corpus")
        model, losses = train_adapter(base, train, cfg, f"adapter {name}", progress)
        path = adapters_dir / name
        model.save_pretrained(str(path))
        (path / "description.txt").write_text(description + "\n")
        inner = model.get_base_model()
        modules = sorted({k.split(".lora_")[0] for k in load_file(str(path / "adapter_model.safetensors"))})
        refused = [m for m in modules if placement_violation(m.removeprefix("base_model.model."), config)]
        rows.append({
            "name": name, "domain": name, "description": description, "modules": len(modules), "refused": refused,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "train_loss_first": losses[0],
            "train_loss_last": sum(losses[-5:]) / len(losses[-5:]),
            "base_valid_loss": mean_loss(base, valid, cfg.batch_size, cfg.chunk_size),
            "adapter_valid_loss": mean_loss(inner, valid, cfg.batch_size, cfg.chunk_size),
            "valid_tokens": int(valid.numel()),
            "engine_logit_gap": engine_gap(base, name, path, inner, valid[:1, :256]),
            "seconds": time.perf_counter() - started})
        row = rows[-1]
        tqdm.write(f"{name}: base {row['base_valid_loss']:.4f} -> adapter {row['adapter_valid_loss']:.4f} on "
                   f"{name}.valid; engine vs PEFT {row['engine_logit_gap']:.2e}")
    path = adapters_dir / "random_l0"
    n_modules = write_random_adapter(base, path, settings.random_rank, settings.random_scale, cfg.seed + 100)
    general = packed_rows(corpus, "general", "valid", tokenizer, cfg.seq_len, cfg.valid_rows, seed=cfg.seed,
                          max_doc_tokens=cfg.max_doc_tokens)
    randomized = V41AdapterSet(copy.deepcopy(base))
    randomized.load("random_l0", path)
    randomized.use("random_l0")
    rows.append({"name": "random_l0", "domain": "general", "description": RANDOM_DESCRIPTION, "modules": n_modules,
                 "refused": [], "trainable_parameters": 0,
                 "base_valid_loss": mean_loss(base, general, cfg.batch_size, cfg.chunk_size),
                 "adapter_valid_loss": mean_loss(randomized.model, general, cfg.batch_size, cfg.chunk_size),
                 "valid_tokens": int(general.numel()), "engine_logit_gap": None})
    (adapters_dir / "adapters.json").write_text(json.dumps({"config": cfg.to_dict(), "targets": adapter_targets(config),
                                                            "adapters": rows}, indent=1) + "\n")
    return rows


# -- manifest ---------------------------------------------------------------------------------------------------

def write_manifest(out: Path, settings: V41DemoSettings, seconds: dict[str, float]) -> dict:
    """manifest.json, adapter_set.json and README.md: the numbers of every stage and the published files."""
    summary = json.loads((out / "pretrain" / "summary.json").read_text())
    quant = json.loads((out / "quantization.json").read_text())
    adapters = json.loads((out / "adapters" / "adapters.json").read_text())["adapters"]
    router = json.loads((out / "router" / "accuracy.json").read_text()) if (out / "router").is_dir() else None
    adapter_set = {"adapters": [{"name": n, "path": f"adapters/{n}", "description": d} for n, d in ADAPTERS.items()]}
    (out / "adapter_set.json").write_text(json.dumps(adapter_set, indent=2) + "\n")
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = path.relative_to(out)
        if rel.parts[0] in ("model", "adapters", "router") and rel.name not in ("README.md", "adapters.json"):
            files[str(rel)] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    total_mb = sum(f["bytes"] for f in files.values()) / 2**20
    pre = {k: v for k, v in summary.items() if k != "history"}
    manifest = {"command": "mol2 build demo --family deepseek_v41", "settings": asdict(settings), "pretrain": pre,
                "valid_history": summary["history"]["valid"], "quantization": quant, "adapters": adapters,
                "router": router, "stage_seconds": seconds, "files": files, "total_mb": total_mb}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "README.md").write_text(readme(manifest))
    return manifest


def readme(m: dict) -> str:
    pre, cfg, text = m["pretrain"], m["pretrain"]["config"], m["pretrain"]["model"]["text_config"]
    decoder_start = max(text["kv_source_layer_ids"])
    lines = [
        "# The DeepSeek-V4.1-layout demo and its adapters", "",
        "Built on CPU by `mol2 build demo --family deepseek_v41` (engine_build/v41_demo.py) from the demo corpus, "
        "with the CED demo's tokenizer. Native tensor names, the release's sharded safetensors and index, "
        "`config.json` with `model_type: deepseek_v41` (ced/deepseek_v41/checkpoint.py reads it; `mol2 inspect` "
        "too).", "",
        "## Shape", "",
        f"Preset `{cfg['preset']}`: {text['num_hidden_layers']} layers (encoder 0..{decoder_start - 1}, "
        f"decoder from {decoder_start}), hidden {text['hidden_size']} x {text['hc_mult']} mHC "
        f"streams, {text['num_attention_heads']} query heads over one {text['head_dim']}-wide K=V latent, window "
        f"{text['sliding_window']}, compress ratios {text['compress_ratios']}, KV sources "
        f"{text['kv_source_layer_ids']}, index sources {text['index_source_layer_ids']}, candidate pool "
        f"{text['candidate_topk_blocks']} blocks of {text['candidate_block_size']}, top-{text['index_topk']}; "
        f"{text['n_routed_experts']} routed experts top-{text['num_experts_per_tok']} + {text['n_shared_experts']} "
        f"shared ({text['moe_intermediate_size']} wide); vocabulary {text['vocab_size']}. "
        f"**{pre['parameters']:,} parameters.**", "",
        "## Pretraining", "",
        f"{pre['steps']} steps x {cfg['batch_size']} rows x {cfg['seq_len']} tokens = **{pre['tokens_seen']:,} "
        f"tokens** in {pre['train_seconds'] / 60:.1f} min of training ({pre['tokens_per_second']:.0f} tokens/s); "
        f"AdamW lr {cfg['lr']} (warmup {cfg['warmup_steps']}, cosine to {cfg['min_lr_ratio']}x), float32, seed "
        f"{cfg['seed']}; experts balanced by the gate bias (no auxiliary loss); the indexer keeps its initial weights. "
        f"Final train loss **{pre['final_train_loss']:.4f}**, validation loss **{pre['final_valid_loss']:.4f}** "
        "nats/token.", "",
        "| step | tokens | valid loss | " + " | ".join(pre["final_valid_per_domain"]) + " |",
        "|---|---|---|" + "---|" * len(pre["final_valid_per_domain"]),
    ]
    for v in m["valid_history"]:
        lines.append(f"| {v['step']} | {v['tokens']:,} | {v['loss']:.4f} | "
                     + " | ".join(f"{v['per_domain'][d]:.3f}" for d in pre["final_valid_per_domain"]) + " |")
    q = m["quantization"]
    lines += ["", "![loss curves](pretrain/loss_curve.png)", "", "## Storage", "",
              f"Validation loss of the weights as each storage keeps them ({q['valid_tokens']:,} tokens); the "
              f"published model uses `{q['published']}` ({q['shards']} shards), which reads back at "
              f"{q['published_valid_loss']:.4f}.", "",
              "| storage | valid loss | change vs float32 | within 1 % | payload bytes |", "|---|---|---|---|---|"]
    lines += [f"| {r['storage']} | {r['valid_loss']:.4f} | {r['change']:+.2%} | {'yes' if r['within_budget'] else 'no'}"
              f" | {r['payload_bytes']:,} |" for r in q["rows"]]
    lines += ["", "## Adapters", "",
              "| adapter | modules | base valid loss | adapter valid loss | change | valid tokens | engine vs PEFT |",
              "|---|---|---|---|---|---|---|"]
    for r in m["adapters"]:
        gap = "-" if r["engine_logit_gap"] is None else f"{r['engine_logit_gap']:.1e}"
        lines.append(f"| {r['name']} | {r['modules']} | {r['base_valid_loss']:.4f} | {r['adapter_valid_loss']:.4f} | "
                     f"{r['adapter_valid_loss'] - r['base_valid_loss']:+.4f} | {r['valid_tokens']} | {gap} |")
    if m["router"]:
        lines += ["", "## Router", "", "MoL2 head (mode B, seed 0) on H19 pooled over the mHC streams.", "",
                  "| split | questions | accuracy |", "|---|---|---|"]
        lines += [f"| {s} | {m['router']['questions'][s]} | {a:.3f} |" for s, a in m["router"]["accuracy"].items()]
    lines += ["", f"## Files ({m['total_mb']:.1f} MB in model/, adapters/ and router/)", "",
              "| file | bytes |", "|---|---|"]
    lines += [f"| {name} | {f['bytes']:,} |" for name, f in m["files"].items()]
    return "\n".join(lines) + "\n"


# -- the build --------------------------------------------------------------------------------------------------

def build_v41_demo(root: str | Path = "artifacts", quick: bool = False, progress: bool = True,
                   threads: int = 2) -> Path:
    """Every stage into ROOT/demo-v41 (ROOT/demo-v41-quick), skipping the ones already done; returns that folder."""
    torch.set_num_threads(threads)
    root = Path(root)
    settings, out = (QUICK, root / "demo-v41-quick") if quick else (FULL, root / "demo-v41")
    corpus, tokenizer = root / "corpus", demo_tokenizer(root)
    if not (corpus / "manifest.json").is_file() and not any(corpus.glob("*.train.jsonl")):
        raise FileNotFoundError(f"{corpus} holds no corpus: build it with `mol2 build corpus --out {corpus}` "
                                "(or `mol2 build demo`, whose first stage it is)")
    stages = [
        ("pretrain", out / "pretrain" / "summary.json", lambda: _pretrain(settings, corpus, tokenizer, out, progress)),
        ("quantize", out / "quantization.json", lambda: quantize_stage(settings, corpus, tokenizer, out, progress)),
        ("adapters", out / "adapters" / "adapters.json", lambda: adapters_stage(settings, corpus, out, progress)),
    ]
    seconds_file = out / "stage_seconds.json"
    seconds = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
    for name, done, run in stages:
        if done.exists():
            print(f"[demo-v41] {name}: already built ({done})")
            continue
        print(f"[demo-v41] {name}: building")
        started = time.perf_counter()
        run()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
        out.mkdir(parents=True, exist_ok=True)
        seconds_file.write_text(json.dumps(seconds, indent=1) + "\n")
    manifest = write_manifest(out, settings, seconds)
    print(f"[demo-v41] ready: {out} ({manifest['total_mb']:.1f} MB of model, adapters and router); see "
          f"{out / 'README.md'}")
    if not (out / "router").is_dir():
        print(f"[demo-v41] next, its router head: mol2 router demo-v41 --root {root}{' --quick' if quick else ''}")
    return out


def _pretrain(settings: V41DemoSettings, corpus: Path, tokenizer: Path, out: Path, progress: bool) -> None:
    summary = pretrain_v41(settings.pretrain, corpus, tokenizer, out, progress=progress)
    if not summary["finished"]:
        raise RuntimeError(f"pretraining stopped at step {summary['step']}; run the same command again to resume")
