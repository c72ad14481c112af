"""Behavioural evaluation of a mapped cache against the native receiver, on held-out text.

Protocol for every item: the sender has prefilled the context; the receiver's cache for all context tokens but
the last comes from the mapper (no receiver prefill); the receiver then reads the last context token and the
following tokens teacher-forced. The native receiver prefills the same receiver tokens itself.
- next_token_kl: KL(native || mapped) of the next-token distribution, mean over the scored positions;
- attention_kl:  KL(native || mapped) of attention rows at those positions, mean over layers, heads, positions;
- top1_agreement: share of scored positions where both pick the same next token;
- mc_agreement: on a 4-way continuation choice built from held-out sentences (true ending + 3 endings of other
  sentences, scored by mean log-likelihood), share of items where the mapped receiver picks what the native
  receiver picks (mc_accuracy_* also reported against the true ending);
- recon_f1: the receiver repeats a question from the mapped cache ("Question: q / Repeat:"), greedy;
  word-level LCS F1 against q.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from . import align, corpus
from .families import Adapter
from .zoo import repeat_prompt


@dataclass
class EvalConfig:
    n_docs: int = 24            # next-token / attention items
    context_chars: int = 600    # context length per item (characters of held-out text)
    score_tokens: int = 16      # scored positions after the cache
    n_mc: int = 24
    n_recon: int = 16
    seed: int = 0


def _cut(doc: str, n: int) -> int:
    i = doc.rfind(" ", 0, n)
    return i if i > n // 2 else n


def make_items(docs: list[str], cfg: EvalConfig) -> dict:
    rng = random.Random(cfg.seed)
    long_docs = [d for d in docs if len(d) > cfg.context_chars + 200]
    lm = []
    for d in rng.sample(long_docs, min(cfg.n_docs, len(long_docs))):
        c = _cut(d, cfg.context_chars)
        lm.append((d[:c], d[c:c + 400]))
    sents = [s for s in corpus.sentences(docs, 8, 18)]
    rng.shuffle(sents)
    mc = []
    for i in range(min(cfg.n_mc, len(sents) // 4)):
        s = sents[i].split()
        k = max(3, int(len(s) * 0.6))
        stem, truth = " ".join(s[:k]), " ".join(s[k:])
        others = [" ".join(o.split()[max(3, int(len(o.split()) * 0.6)):]) for o in sents[len(sents) - 3 * (i + 1):len(sents) - 3 * i]]
        opts = [truth, *others]
        rng.shuffle(opts)
        mc.append((stem, opts, opts.index(truth)))
    recon = sents[cfg.n_mc: cfg.n_mc + cfg.n_recon]
    return {"lm": lm, "mc": mc, "recon": recon}


def selection_items(prompts: list[str], tok, scored: int = 16) -> dict:
    """The selection split: calibration held-out prompts scored like the evaluation (the context up to the prompt's
    last `scored` receiver tokens is mapped; those tokens are teacher-forced). Next-token and attention items only."""
    lm = []
    for text in prompts:
        ends = tok.encode(text)[1]
        if len(ends) > 2 * scored:
            cut = ends[-scored - 1]
            lm.append((text[:cut], text[cut:]))
    return {"lm": lm, "mc": [], "recon": []}


def _kl_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _attn_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    p, q = p.double(), q.double()
    t = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - torch.log(q.clamp_min(1e-30))), 0.0)
    return t.sum(-1)


def lcs_f1(pred: str, ref: str) -> float:
    a, b = pred.split(), ref.split()
    if not a or not b:
        return 0.0
    dp = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a)):
        for j in range(len(b)):
            dp[i + 1][j + 1] = dp[i][j] + 1 if a[i] == b[j] else max(dp[i][j + 1], dp[i + 1][j])
    l = dp[-1][-1]
    if l == 0:
        return 0.0
    p, r = l / len(a), l / len(b)
    return 2 * p * r / (p + r)


class Direction:
    """Sender and receiver (ZooModel-like: .adapter, .tok) and the way a method builds the receiver's cache."""

    def __init__(self, sender, receiver):
        self.s, self.r = sender, receiver
        self.S, self.R = sender.adapter, receiver.adapter
        self._sender = {}                        # text -> (sender capture, end offsets): the sender prefills once

    def sender_side(self, text: str):
        if text not in self._sender:
            s_ids, s_ends = self.s.tok.encode(text)
            self._sender[text] = (self.S.capture(s_ids), s_ends)
        return self._sender[text]

    def kv(self, method: str, mapper, text: str):
        """Receiver ids of `text` and the per-layer pre-norm K/V for all of them but the last."""
        r_ids, r_ends = self.r.tok.encode(text)
        if mapper is None:                                          # text re-prefill: the receiver's own K/V
            cap = self.R.capture(r_ids[:-1])
            return r_ids, cap.k, cap.v
        cap, s_ends = self.sender_side(text)
        pairs = align.pair(s_ends, r_ends[:-1], getattr(mapper, "pairing", "ta"))
        ks, vs = mapper.apply(cap, pairs)
        return r_ids, ks, vs

    def score(self, ks, vs, feed: list[int], attentions: bool):
        return self.R.decode_from(self.R.build_cache(ks, vs), feed, attentions=attentions)


@torch.no_grad()
def evaluate(direction: Direction, methods: dict, items: dict, progress: bool = True) -> list[dict]:
    """methods: name -> mapper (None for text_reprefill). Returns one row per method; its `per_item` holds the
    next-token and attention KL of every next-token item, for paired comparisons between methods."""
    R, rt = direction.R, direction.r.tok
    stats = {m: {"nt": [], "top1": [], "att": [], "mc": [], "mc_acc": [], "recon": []} for m in methods}
    bar = tqdm(items["lm"], desc="eval lm", disable=not progress, leave=False)
    for ctx, tail in bar:
        r_ids = rt.ids(ctx)
        feed = [r_ids[-1]] + rt.ids(tail)[:15]
        native = R.model(input_ids=torch.tensor([r_ids + feed[1:]]), output_attentions=True)
        n = len(feed)
        nat_logits = native.logits[0, -n:]
        nat_att = [a[0, :, -n:, :] for a in native.attentions]
        for name, mapper in methods.items():
            _, ks, vs = direction.kv(name, mapper, ctx)
            out = direction.score(ks, vs, feed, attentions=True)
            st = stats[name]
            st["nt"].append(float(_kl_rows(nat_logits, out.logits[0]).mean()))
            st["top1"].append(float((nat_logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean()))
            st["att"].append(float(torch.stack([_attn_kl(p, q[0]).mean() for p, q in zip(nat_att, out.attentions)]).mean()))
    for stem, opts, truth in tqdm(items["mc"], desc="eval mc", disable=not progress, leave=False):
        opt_ids = [rt.ids(" " + o) or [0] for o in opts]
        r_ids = rt.ids(stem)
        nat = _mc_choice(R, r_ids, opt_ids, None)
        for name, mapper in methods.items():
            _, ks, vs = direction.kv(name, mapper, stem)
            choice = _mc_choice(R, r_ids, opt_ids, (ks, vs))
            stats[name]["mc"].append(float(choice == nat))
            stats[name]["mc_acc"].append(float(choice == truth))
    for q in tqdm(items["recon"], desc="eval recon", disable=not progress, leave=False):
        n_new = len(rt.ids(" " + q)) + 2
        for name, mapper in methods.items():
            r_ids, ks, vs = direction.kv(name, mapper, repeat_prompt(q))
            gen = R.greedy(R.build_cache(ks, vs), r_ids[-1], n_new)
            stats[name]["recon"].append(lcs_f1(rt.decode(gen).split("\n")[0], q))
    rows = []
    for name, st in stats.items():
        mean = lambda key: float(np.mean(st[key])) if st[key] else None      # None: the split has no such items
        rows.append({"method": name, "next_token_kl": mean("nt"), "attention_kl": mean("att"),
                     "top1_agreement": mean("top1"), "mc_agreement": mean("mc"), "mc_accuracy": mean("mc_acc"),
                     "recon_f1": mean("recon"), "per_item": {"next_token_kl": st["nt"], "attention_kl": st["att"]}})
    return rows


def _mc_choice(R: Adapter, r_ids: list[int], opt_ids: list[list[int]], kv) -> int:
    scores = []
    for ids in opt_ids:
        feed = [r_ids[-1]] + ids
        if kv is None:
            logits = R.model(input_ids=torch.tensor([r_ids + ids])).logits[0, -len(feed):]
        else:
            logits = R.decode_from(R.build_cache(*kv), feed).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1)
        scores.append(float(lp.gather(1, torch.tensor(ids).view(-1, 1)).mean()))
    return int(np.argmax(scores))
