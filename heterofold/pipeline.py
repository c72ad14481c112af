"""End-to-end steps the CLI and the benchmarks share: calibration data, fit + save a map, apply a saved map."""
from __future__ import annotations

from pathlib import Path

import torch

from . import align, corpus, mapfile, registry
from .baselines import fit_method
from .calibrate import collect
from .fold import transfer
from .zoo import ROOT, ZooModel

# Calibration prompts: the seed calibrates on 1600 + 400 held out (4:1) and reports that more data helps most; the
# calib split has about 580 prompts of >= 200 characters, so the default takes 448 + 112 of them (4:1). With 64
# prompts, 4 epochs are 256 optimizer steps and the held-out loss is still falling when calibration stops.
N_TRAIN, N_HELD = 448, 112


def parse_direction(text: str) -> tuple[str, str]:
    """"SENDER:RECEIVER" -> (sender, receiver), two different families (an argparse `type`)."""
    from argparse import ArgumentTypeError

    known = registry.family_names()
    sender, _, receiver = text.partition(":")
    if sender not in known or receiver not in known or sender == receiver:
        raise ArgumentTypeError(f"{text!r} is not SENDER:RECEIVER with two different families of "
                                f"{', '.join(sorted(known))}")
    return sender, receiver


def calibration_texts(n_train: int, n_held: int, chars: int = 600, root: Path = ROOT):
    """Calibration prompts (first `chars` characters of calib-split documents): train and held-out parts. Both must
    be non-empty (the held-out part picks the calibration checkpoint) and fit in the split."""
    docs = [d[:chars] for d in corpus.build(root / "corpus.json")["calib"] if len(d) >= 200]
    if n_train < 1 or n_held < 1 or n_train + n_held > len(docs):
        raise ValueError(f"asked for {n_train} calibration + {n_held} held-out prompts; the calib split holds "
                         f"{len(docs)}: both at least 1, together at most {len(docs)}")
    return docs[:n_train], docs[n_train:n_train + n_held]


def collect_direction(s: ZooModel, r: ZooModel, n_train: int, n_held: int, root: Path = ROOT):
    tr, he = calibration_texts(n_train, n_held, root=root)
    return (collect(s.adapter, r.adapter, s.tok, r.tok, tr, desc="capture calib"),
            collect(s.adapter, r.adapter, s.tok, r.tok, he, desc="capture held-out"),
            corpus.fingerprint(tr + he))


def fit_and_save(s: ZooModel, r: ZooModel, out: Path, n_train: int = N_TRAIN, n_held: int = N_HELD,
                 root: Path = ROOT):
    train, held, calib_hash = collect_direction(s, r, n_train, n_held, root)
    m, curves = fit_method("heterofold", s.adapter, r.adapter, train, held, progress=True)
    mapfile.save(m, out, mapfile.fingerprint(s.adapter, s.tok), mapfile.fingerprint(r.adapter, r.tok),
                 calib_hash, {"calibration_curves": curves, "n_train": len(train), "n_held": len(held)})
    return m, curves


def require_map(path: Path, sender: str, receiver: str) -> None:
    if not (Path(path) / "map.json").is_file():
        raise FileNotFoundError(f"no map at {path}: run `heterofold fit --sender {sender} --receiver {receiver}` first")


def load_map(path: Path, s: ZooModel, r: ZooModel):
    """A saved map, checked against both models' fingerprints."""
    require_map(path, s.spec.name, r.spec.name)
    return mapfile.load(path, mapfile.fingerprint(s.adapter, s.tok), mapfile.fingerprint(r.adapter, r.tok))


@torch.no_grad()
def continue_from_capture(m, cap, sender_ends, r: ZooModel, text: str, max_new: int) -> list[int]:
    """The receiver side: align the sender's tokens to the receiver's, map + install all context tokens but the
    last, and greedy-decode from the last one. Returns the receiver's new token ids."""
    r_ids, r_ends = r.tok.encode(text)
    if len(r_ids) < 2:
        raise ValueError(f"text of {len(r_ids)} receiver token(s): a mapped cache needs at least 2")
    pairs = align.token_alignment(sender_ends, r_ends[:-1])
    cache = transfer(m, cap, pairs, r.adapter)
    return r.adapter.greedy(cache, r_ids[-1], max_new)


@torch.no_grad()
def apply_map_ids(path: Path, s: ZooModel, r: ZooModel, text: str, max_new: int = 24) -> list[int]:
    """Sender prefills `text`; the receiver continues from the mapped cache (no receiver prefill): new token ids."""
    m = load_map(path, s, r)
    if not text.strip():
        raise ValueError("the text is empty: the sender has nothing to prefill")
    s_ids, s_ends = s.tok.encode(text)
    return continue_from_capture(m, s.adapter.capture(s_ids), s_ends, r, text, max_new)


def apply_map(path: Path, s: ZooModel, r: ZooModel, text: str, max_new: int = 24) -> str:
    return r.tok.decode(apply_map_ids(path, s, r, text, max_new))


@torch.no_grad()
def native_continuation(r: ZooModel, text: str, max_new: int = 24) -> str:
    """The reference: the receiver prefills `text` itself."""
    r_ids = r.tok.ids(text)
    cap = r.adapter.capture(r_ids[:-1])
    return r.tok.decode(r.adapter.greedy(r.adapter.build_cache(cap.k, cap.v), r_ids[-1], max_new))
