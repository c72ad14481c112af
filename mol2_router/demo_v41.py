"""`mol2 router demo-v41`: the deepseek_v41 demo's router head, trained on that model's H19 once
`mol2 build demo --family deepseek_v41` has built the model and its adapters (engine_build/v41_demo.py). Here, not
in the build, because the router sits above the build (its data reuses the build's corpus readers)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ced.deepseek_v41 import checkpoint as ckpt
from engine_build.v41_demo import FULL, QUICK, write_manifest

from .builders import adapter_candidates, build_all
from .config import RouterConfig
from .data import read_questions
from .features import RouteTokenizer, cached_features
from .pipeline import OPTIONAL_SPLITS, SPLITS, evenly
from .router import MoL2Router
from .train import OptionTable, RouteSet, Scorer, TrainConfig, accuracy, new_scorer, train_head


def train_v41_head(root: str | Path = "artifacts", quick: bool = False, progress: bool = True) -> dict:
    """mol2_router's recipe (mode B, seed 0, last checkpoint) on this model's H19, pooled over the mHC streams
    (mol2_router.features.token_h19) and then over the turn's positions, into ROOT/demo-v41/router (the quick
    build's with `quick`); the demo's manifest and README are written again with its accuracy."""
    root = Path(root)
    settings, out = (QUICK, root / "demo-v41-quick") if quick else (FULL, root / "demo-v41")
    if not (out / "adapters" / "adapters.json").is_file():
        raise FileNotFoundError(f"{out} holds no built demo: run `mol2 build demo --family deepseek_v41"
                                f"{' --quick' if quick else ''}` first")
    started = time.perf_counter()
    data_dir = root / "router" / "data"
    if not (data_dir / "domain.train.jsonl").is_file():
        build_all(data_dir, corpus=root / "corpus", apt_lists=root / "apt" / "lists")
    config, model = ckpt.load_checkpoint(out / "model")
    tokenizer = RouteTokenizer(out / "model" / "tokenizer.json")
    head_config = RouterConfig.from_name("demo", hidden_size=config.hidden_size)
    sets = {}
    for split in SPLITS + OPTIONAL_SPLITS:
        path = data_dir / f"{split}.jsonl"
        if split in OPTIONAL_SPLITS and not path.exists():
            continue
        questions = read_questions(path)
        questions = [questions[i] for i in evenly(questions, settings.router_limits.get(split))]
        features = cached_features(model, out / "model", tokenizer, questions, out / "router-work" / "features",
                                   "mol2", head_config.max_option_tokens, progress=progress)
        sets[split] = RouteSet(split, questions, features)
    table = OptionTable(tokenizer, head_config.max_option_tokens)
    embedding = model.embed.weight.detach().float()
    train = TrainConfig(mode="B", epochs=settings.router_epochs, seed=0)
    result = train_head(new_scorer("mol2", head_config, embedding, 0), sets["generic.train"], sets["domain.train"],
                        [sets["generic.dev"], sets["domain.dev"]], train, table, progress=progress)
    scorer = Scorer(result.last, embedding)
    scores = {split: accuracy(scorer, rs, table) for split, rs in sets.items()}
    counts = {split: len(rs) for split, rs in sets.items()}
    router = MoL2Router(result.last, embedding, tokenizer, adapter_candidates(out / "adapters"))
    router.save(out / "router", backbone=out / "model",
                meta={"mode": "B", "seed": 0, "epochs": settings.router_epochs, "checkpoint": "last",
                      "trained_backbone": True, "h19_pooling": "mean over the mHC streams, then over the turn"})
    report = {"accuracy": scores, "questions": counts, "limits": settings.router_limits, "epochs": train.epochs}
    (out / "router" / "accuracy.json").write_text(json.dumps(report, indent=1) + "\n")
    seconds_file = out / "stage_seconds.json"
    seconds = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
    seconds["router"] = seconds.get("router", 0.0) + time.perf_counter() - started
    seconds_file.write_text(json.dumps(seconds, indent=1) + "\n")
    write_manifest(out, settings, seconds)
    return report
