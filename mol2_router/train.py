"""Head training on cached H19 features: the seed's recipe modes, seeds, last and dev-selected checkpoints.

Modes (seed, "Training-data recipe"): A = generic data only; B = generic and domain data mixed (the default);
C = as A, then domain data only. As in the seed, every stage runs the same number of epochs (30) and the last
checkpoint is the one reported; the dev-selected checkpoint maximizes the mean accuracy over the dev sets given
(generic.dev and domain.dev by default). Mode C's first stage is exactly mode A under the same seed, so one C run
also yields the A run (`TrainResult.stages[0]`, bitwise what a separate A run gives).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from .config import RouterConfig
from .data import Question
from .features import ROUTE_PROMPT, Features, RouteTokenizer, option_tokens, pad_batch
from .head import PointerHead, QKHead

MODES = ("A", "B", "C")


@dataclass
class RouteSet:
    """Questions of one split with their features, in question order."""

    name: str
    questions: list[Question]
    features: Features

    def __len__(self) -> int:
        return len(self.questions)

    def subset(self, indices: list[int], name: str | None = None) -> "RouteSet":
        f = self.features
        if f.options is None:
            feats = Features(f.query[indices])
        else:
            opts = [f.options_of(i) for i in indices]
            counts = torch.tensor([len(o) for o in opts])
            feats = Features(f.query[indices], torch.cat(opts),
                             torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
        return RouteSet(name or self.name, [self.questions[i] for i in indices], feats)


class OptionTable:
    """Every distinct option text of the data, tokenized once (route prompt + "name: description")."""

    def __init__(self, tokenizer: RouteTokenizer, max_option_tokens: int, route_prompt: str = ROUTE_PROMPT):
        self.tokenizer, self.max_option_tokens, self.route_prompt = tokenizer, max_option_tokens, route_prompt
        self.index: dict[str, int] = {}
        self.ids: list[list[int]] = []

    def add(self, question: Question) -> list[int]:
        out = []
        for c in question.candidates:
            text = c.option_text()
            if text not in self.index:
                self.index[text] = len(self.ids)
                self.ids.append(option_tokens(self.tokenizer, text, self.max_option_tokens, question.where,
                                              self.route_prompt))
            out.append(self.index[text])
        return out

    def batch(self, rows: list[int]) -> tuple[Tensor, Tensor]:
        ids, lengths = pad_batch([self.ids[r] for r in rows])
        return ids, torch.arange(ids.shape[1])[None, :] < lengths[:, None]


@dataclass
class Batch:
    query: Tensor  # (B, C)
    labels: Tensor  # (B,)
    candidate_mask: Tensor  # (B, N)
    candidates: Tensor | None = None  # (B, N) into option_ids (MoL2)
    option_ids: Tensor | None = None  # (U, T) token ids of the batch's distinct options (MoL2)
    option_mask: Tensor | None = None  # (U, T)
    options: Tensor | None = None  # (B, N, C) contextual H19 (Contextual MoL)


def make_batch(rs: RouteSet, indices: list[int], table: OptionTable | None) -> Batch:
    qs = [rs.questions[i] for i in indices]
    N = max(len(q.candidates) for q in qs)
    cmask = torch.zeros(len(qs), N, dtype=torch.bool)
    for b, q in enumerate(qs):
        cmask[b, : len(q.candidates)] = True
    labels = torch.tensor([q.label_index for q in qs])
    batch = Batch(rs.features.query[indices].float(), labels, cmask)
    if table is not None:  # MoL2: gather the batch's distinct options
        rows = [table.add(q) for q in qs]
        distinct = sorted({r for row in rows for r in row})
        where = {r: i for i, r in enumerate(distinct)}
        cand = torch.zeros(len(qs), N, dtype=torch.long)
        for b, row in enumerate(rows):
            cand[b, : len(row)] = torch.tensor([where[r] for r in row])
        batch.candidates = cand
        batch.option_ids, batch.option_mask = table.batch(distinct)
    else:  # Contextual MoL: the options' own H19
        C = rs.features.query.shape[1]
        options = torch.zeros(len(qs), N, C)
        for b, i in enumerate(indices):
            o = rs.features.options_of(i)
            options[b, : len(o)] = o.float()
        batch.options = options
    return batch


class Scorer:
    """One interface over the two trainable heads: logits for a batch."""

    def __init__(self, head: nn.Module, embedding: Tensor | None = None):
        self.head, self.embedding = head, embedding

    @property
    def is_mol2(self) -> bool:
        return isinstance(self.head, PointerHead)

    def __call__(self, batch: Batch) -> Tensor:
        if self.is_mol2:
            embeds = F.embedding(batch.option_ids, self.embedding)  # (U, T, C): the frozen token embedding
            return self.head(batch.query, embeds, batch.option_mask, batch.candidates, batch.candidate_mask)
        return self.head(batch.query, batch.options, batch.candidate_mask)


MAX_BATCH_OPTIONS = 512  # distinct options per batch: the cross-attention reads every token of every one


def source_batches(items: list[tuple[RouteSet, int]], batch_size: int, rng: random.Random | None,
                   max_options: int = MAX_BATCH_OPTIONS) -> list[list]:
    """Batches that each hold questions of one set and one source, so a batch's distinct options stay few (the
    option side runs once per distinct option and step); shuffled within sources and across batches. A batch
    closes early when its distinct options would pass `max_options` (data whose every question brings options of
    its own, e.g. matching a text to one of many named items, would otherwise build a batch of tens of thousands)."""
    by_source: dict[tuple[int, str], list] = {}
    for rs, i in items:
        by_source.setdefault((id(rs), rs.questions[i].source), []).append((rs, i))
    groups: dict[tuple[int, str], list] = {}
    for (set_id, source), members in by_source.items():
        sets = {rs.questions[i].candidates for rs, i in members}
        # sources that share one fixed candidate set (the demo domains, a user's own adapters) form one group,
        # so that such batches mix labels; generic sources (a candidate set per question) stay apart
        key = (set_id, repr(next(iter(sets)))) if len(sets) == 1 else (set_id, source)
        groups.setdefault(key, []).extend(members)
    batches = []
    for key in sorted(groups, key=lambda k: k[1]):
        group = groups[key]
        if rng is not None:
            rng.shuffle(group)
        batches += _capped(group, batch_size, max_options)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def _capped(group: list[tuple[RouteSet, int]], batch_size: int, max_options: int) -> list[list]:
    """Consecutive batches of at most `batch_size` questions and (unless one question alone has more) at most
    `max_options` distinct options."""
    batches, current, options = [], [], set()
    for rs, i in group:
        mine = set(rs.questions[i].candidates)
        if current and (len(current) == batch_size or len(options | mine) > max_options):
            batches.append(current)
            current, options = [], set()
        current.append((rs, i))
        options |= mine
    return batches + ([current] if current else [])


@torch.no_grad()
def predict(scorer: Scorer, rs: RouteSet, table: OptionTable | None, batch_size: int = 256) -> Tensor:
    """Predicted candidate index per question (n,)."""
    scorer.head.eval()
    out = torch.zeros(len(rs), dtype=torch.long)
    for batch in source_batches([(rs, i) for i in range(len(rs))], batch_size, None):
        idx = [i for _, i in batch]
        out[idx] = scorer(make_batch(rs, idx, table)).argmax(-1)
    return out


def accuracy(scorer: Scorer, rs: RouteSet, table: OptionTable | None) -> float:
    labels = torch.tensor([q.label_index for q in rs.questions])
    return float((predict(scorer, rs, table) == labels).float().mean()) if len(rs) else float("nan")


@dataclass
class TrainConfig:
    mode: str = "B"
    epochs: int = 30  # per stage (the seed's 30)
    batch_size: int = 256  # questions of one source per batch
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    seed: int = 0
    domain_repeat: int = 1  # mode B: how many times domain train enters each epoch

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class TrainResult:
    last: nn.Module
    best: nn.Module
    best_epoch: int
    history: list[dict] = field(default_factory=list)
    stages: list["TrainResult"] = field(default_factory=list)  # per stage: its last, its dev-best, its epochs


def stages(mode: str, generic: RouteSet, domain: RouteSet) -> list[list[tuple[RouteSet, int]]]:
    """Per stage, the (set, index) pairs one epoch visits."""
    g = [(generic, i) for i in range(len(generic))]
    d = [(domain, i) for i in range(len(domain))]
    return {"A": [g], "B": [g + d], "C": [g, d]}[mode]


def train_head(scorer: Scorer, generic: RouteSet, domain: RouteSet, dev: list[RouteSet], config: TrainConfig,
               table: OptionTable | None = None, progress: bool = True, log=print) -> TrainResult:
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    head = scorer.head
    plan = stages(config.mode, generic, domain)
    if config.mode == "B" and config.domain_repeat > 1:
        plan = [plan[0] + [(domain, i) for i in range(len(domain))] * (config.domain_repeat - 1)]
    steps_per_stage = [config.epochs * len(source_batches(items, config.batch_size, None)) for items in plan]
    first = [rs for rs in (generic, domain) if len(rs) and any(r is rs for r, _ in plan[0])]
    query = torch.cat([rs.features.query for rs in first])  # the first stage's training queries
    if isinstance(head, PointerHead):
        head.set_query_stats(query)
    else:
        head.set_query_stats(query, torch.cat([rs.features.options for rs in first]))
    total = sum(steps_per_stage)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=config.lr,
                                  weight_decay=config.weight_decay)
    history, best, epoch_no, stage_results = [], _Best(), 0, []
    bar = tqdm(total=total, desc=f"train {config.mode} seed {config.seed}", disable=not progress, leave=False)
    for stage, items in enumerate(plan):  # each stage has its own warmup + cosine schedule (mode C continues)
        n = steps_per_stage[stage]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s, n=n: min(1.0, (s + 1) / config.warmup_steps)
                                                     * 0.5 * (1 + math.cos(math.pi * min(s, n) / n)))
        stage_best, stage_rows = _Best(), []
        for _ in range(config.epochs):
            head.train()
            losses = []
            for chunk in source_batches(items, config.batch_size, rng):
                rs, idx = chunk[0][0], [i for _, i in chunk]
                batch = make_batch(rs, idx, table)
                loss = F.cross_entropy(scorer(batch), batch.labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                losses.append(float(loss.detach()))
                bar.update()
            epoch_no += 1
            row = {"epoch": epoch_no, "stage": stage, "loss": sum(losses) / len(losses)}
            for rs in dev:
                row[f"acc_{rs.name}"] = accuracy(scorer, rs, table)
            score = sum(row[f"acc_{rs.name}"] for rs in dev) / max(1, len(dev))
            best.offer(score, epoch_no, head)
            stage_best.offer(score, epoch_no, head)
            history.append(row)
            stage_rows.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", dev=f"{score:.3f}")
        stage_results.append(TrainResult(copy.deepcopy(head).eval(), stage_best.module(head), stage_best.epoch,
                                         stage_rows))
    bar.close()
    return TrainResult(head.eval(), best.module(head), best.epoch, history, stage_results)


class _Best:
    """The dev-best weights seen so far (ties keep the earlier epoch)."""

    def __init__(self):
        self.score, self.epoch, self.state = -1.0, -1, None

    def offer(self, score: float, epoch: int, head: nn.Module) -> None:
        if score > self.score:
            self.score, self.epoch, self.state = score, epoch, copy.deepcopy(head.state_dict())

    def module(self, head: nn.Module) -> nn.Module:
        out = copy.deepcopy(head)
        if self.state is not None:
            out.load_state_dict(self.state)
        return out.eval()


def new_scorer(kind: str, config: RouterConfig, embedding: Tensor | None, seed: int = 0) -> Scorer:
    torch.manual_seed(seed)
    if kind == "mol2":
        return Scorer(PointerHead(config), embedding.detach().float())
    return Scorer(QKHead(config.hidden_size, config.d_model))
