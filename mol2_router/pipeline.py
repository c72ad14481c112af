"""The end-to-end recipe on the demo model: which checkpoint, which data, extraction, training runs, evaluation.

Layout under `artifacts/router/` (the work folder): `data/*.jsonl`, `features/<model>/...` (H19 shards),
`runs/<model>/<kind>-<mode>-seed<s>/{last,best}/` (heads) and `history.json`. The served head goes to the demo's
router/ beside its adapters (artifacts/demo/router for a fresh build: ced/demo.py says which demo).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ced.demo import Demo, untrained_demo  # which demo: ced.demo.resolve_demo, the order all commands share

from .config import RouterConfig
from .data import Question, read_questions
from .features import RouteTokenizer, cached_features
from .head import PointerHead, QKHead
from .train import (OptionTable, RouteSet, Scorer, TrainConfig, TrainResult, accuracy, new_scorer, predict,
                    train_head)

WORK = Path("artifacts/router")
SPLITS = ("generic.train", "generic.dev", "generic.test", "domain.train", "domain.dev", "domain.bench")
OPTIONAL_SPLITS = ("domain.freeform",)  # test-only splits, used when their file exists (`mol2 router data`)
CONTEXTUAL_LIMITS = {"generic.train": 600, "generic.dev": 150, "generic.test": 300}  # its extraction is ~10x dearer


def demo_engine(demo: Demo, root: str | Path | None = None, log=print):
    """The demo engine with every adapter of the demo loaded. MoL's `random_l0` is a seeded random adapter of the
    demo shape: when the trained demo has none (yet), the untrained demo's is loaded in its place (noted)."""
    from ced import CEDEngine, CEDForCausalLM

    engine = CEDEngine(CEDForCausalLM.from_pretrained(str(demo.model_dir)), max_adapters=8, max_rank=16)
    folders = sorted(p for p in demo.adapters_dir.iterdir() if (p / "adapter_config.json").exists()) \
        if demo.adapters_dir.is_dir() else []
    from ced import AdapterError

    for path in folders:
        try:
            engine.adapters.load(path.name, path)
        except AdapterError as error:  # e.g. a baseline adapter the placement rule refuses
            if log:
                log(f"note: skipped adapter {path.name}: {str(error)[:160]}")
    if "random_l0" not in engine.adapters:
        fallback = untrained_demo(None if root is None else Path(root) / "demo-untrained").adapters_dir / "random_l0"
        engine.adapters.load("random_l0", fallback)
        if log:
            log(f"note: {demo.adapters_dir} has no random_l0; MoL uses {fallback} (a seeded random adapter either way)")
    return engine


def load_model(model_dir: str | Path):
    from ced import CEDForCausalLM

    return CEDForCausalLM.from_pretrained(str(model_dir)).eval()


def evenly(questions: list[Question], n: int | None) -> list[int]:
    """n indices spread evenly over the list (every source and label kept in proportion)."""
    if n is None or n >= len(questions):
        return list(range(len(questions)))
    return sorted({int(i * len(questions) / n) for i in range(n)})


def load_sets(model, demo: Demo, data_dir: str | Path | None, kind: str, config: RouterConfig,
              splits=SPLITS + OPTIONAL_SPLITS, limits: dict[str, int] | None = None, progress: bool = True,
              log=print, files: dict[str, Path] | None = None) -> dict[str, RouteSet]:
    """Each split's questions (`data_dir`/SPLIT.jsonl, or `files[SPLIT]`) with their cached H19 features."""
    tok = RouteTokenizer(demo.tokenizer)
    cache = WORK / "features" / demo.tag
    sets = {}
    for split in splits:
        path = Path(files[split]) if files and split in files else Path(data_dir) / f"{split}.jsonl"
        if split in OPTIONAL_SPLITS and not path.exists():
            continue
        questions = read_questions(path)
        keep = evenly(questions, (limits or {}).get(split))
        questions = [questions[i] for i in keep]
        feats = cached_features(model, demo.model_dir, tok, questions, cache, kind, config.max_option_tokens,
                                progress=progress, log=log)
        sets[split] = RouteSet(split, questions, feats)
    return sets


# -- checkpoints --------------------------------------------------------------------------------------------

def save_head(folder: str | Path, head: torch.nn.Module, config: RouterConfig, meta: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kind = "mol2" if isinstance(head, PointerHead) else "contextual"
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(folder / "head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"kind": kind, "router": config.to_dict(), **meta}, indent=2) + "\n")


def load_head(folder: str | Path) -> tuple[torch.nn.Module, RouterConfig, dict]:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no router head in {folder}: train one with `mol2 router train` "
                                "(its --kind, --modes and --seeds name the run folder) or pass --head FOLDER")
    meta = json.loads((folder / "config.json").read_text())
    config = RouterConfig.from_dict(meta["router"])
    head = PointerHead(config) if meta["kind"] == "mol2" else QKHead(config.hidden_size, config.d_model)
    head.load_state_dict(load_file(str(folder / "head.safetensors")))
    return head.eval(), config, meta


def run_dir(demo: Demo, kind: str, mode: str, seed: int) -> Path:
    return WORK / "runs" / demo.tag / f"{kind}-{mode}-seed{seed}"


def default_limits(kind: str, limits: dict[str, int] | None = None) -> dict[str, int]:
    """Questions kept per split (evenly spread); Contextual MoL's extraction is ~10x dearer, so it keeps fewer."""
    return {**(CONTEXTUAL_LIMITS if kind == "contextual" else {}), **(limits or {})}


def train_runs(demo: Demo, data_dir: str | Path, kind: str, modes, seeds, epochs: int, preset: str = "demo",
               batch_size: int = 256, progress: bool = True, log=print, limits: dict[str, int] | None = None,
               share_stages: bool = True) -> list[dict]:
    """Train every (mode, seed); save last and dev-selected heads; return one summary row per run.

    With `share_stages`, mode C runs before mode A and A is taken from C's first stage (the same training, bitwise),
    which saves a third of a full A/B/C sweep."""
    if share_stages and "A" in modes and "C" in modes:
        modes = ["C"] + [m for m in modes if m != "C"]
    config = RouterConfig.from_name(preset, dropout=0.1)
    model = load_model(demo.model_dir)
    limits = default_limits(kind, limits)
    sets = load_sets(model, demo, data_dir, kind, config, limits=limits, progress=progress, log=log)
    tok = RouteTokenizer(demo.tokenizer)
    table = OptionTable(tok, config.max_option_tokens) if kind == "mol2" else None
    rows = []
    for seed in seeds:  # seed-major: an interrupted sweep still has every mode at its first seeds
        done: dict[str, TrainResult] = {}
        for mode in modes:
            if mode in done:  # mode A, already trained as mode C's first stage
                result, started = done[mode], time.time()
            else:
                scorer = new_scorer(kind, config, model.model.embed_tokens.weight, seed)
                started = time.time()
                result = train_head(scorer, sets["generic.train"], sets["domain.train"],
                                    [sets["generic.dev"], sets["domain.dev"]],
                                    TrainConfig(mode=mode, epochs=epochs, seed=seed, batch_size=batch_size), table,
                                    progress=progress, log=log)
                if mode == "C" and share_stages:
                    done["A"] = result.stages[0]
            folder = run_dir(demo, kind, mode, seed)
            meta = {"mode": mode, "seed": seed, "epochs": epochs, "model_dir": str(demo.model_dir),
                    "tokenizer": str(demo.tokenizer), "trained_backbone": demo.trained, "limits": limits}
            save_head(folder / "last", result.last, config, meta)
            save_head(folder / "best", result.best, config, {**meta, "best_epoch": result.best_epoch})
            (folder / "history.json").write_text(json.dumps(result.history, indent=1) + "\n")
            row = {"kind": kind, "mode": mode, "seed": seed, "best_epoch": result.best_epoch,
                   "train_s": round(time.time() - started, 1)}
            embedding = model.model.embed_tokens.weight.detach().float() if kind == "mol2" else None
            for ckpt, head in (("last", result.last), ("best", result.best)):
                s = Scorer(head, embedding)
                for split, rs in sets.items():
                    row[f"{ckpt}:{split}"] = accuracy(s, rs, table)
            log(json.dumps(row))
            rows.append(row)
    return rows


def evaluate_run(demo: Demo, data_dir: str | Path | None, folder: str | Path, splits=SPLITS + OPTIONAL_SPLITS,
                 progress: bool = False, files: dict[str, Path] | None = None) -> list[dict]:
    """Per-question predictions of one saved head (its kind read from the head's config.json):
    [{split, source, label, predicted, correct}]. `files` evaluates a file of one's own as a split."""
    head, config, meta = load_head(folder)
    kind = meta["kind"]
    model = load_model(demo.model_dir)
    limits = meta.get("limits", default_limits(kind)) if set(splits) <= set(SPLITS + OPTIONAL_SPLITS) else None
    sets = load_sets(model, demo, data_dir, kind, config, splits, limits, progress=progress, log=None, files=files)
    table = OptionTable(RouteTokenizer(demo.tokenizer), config.max_option_tokens) if kind == "mol2" else None
    scorer = Scorer(head, model.model.embed_tokens.weight.detach().float() if kind == "mol2" else None)
    out = []
    for split, rs in sets.items():
        pred = predict(scorer, rs, table)
        for q, p in zip(rs.questions, pred.tolist()):
            out.append({"split": split, "source": q.source, "label": q.label, "predicted": q.candidates[p].name,
                        "correct": q.candidates[p].name == q.label})
    return out
