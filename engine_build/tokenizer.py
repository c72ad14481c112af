"""Byte-level BPE tokenizer for the demo model, trained with `tokenizers` on the corpus (`engine_build.corpus`).

The model is GPT-2-style byte-level BPE: no normalizer (decoding gives back exactly the input, any UTF-8),
the ByteLevel pre-tokenizer (GPT-2 split regex, no prefix space), the ByteLevel decoder, and a ByteLevel
post-processor with `trim_offsets=False`, so `Encoding.offsets` are character offsets into the input string
and `text[start:end]` is what each token covers (a character split over two byte tokens is covered by both).
Nothing is added automatically at encode time: callers add `<|bos|>`/`<|eos|>` themselves, or use
`encode_chat`.

Special tokens (ids fixed by their order, 0..5; each one token, never merged, never produced from text by BPE):

| id | token           | meaning                                                               |
|----|-----------------|-----------------------------------------------------------------------|
| 0  | `<|bos|>`       | start of a document or conversation                                   |
| 1  | `<|eos|>`       | end of a document or conversation                                     |
| 2  | `<|pad|>`       | padding; never attended to or trained on                              |
| 3  | `<|user|>`      | a user turn begins                                                    |
| 4  | `<|assistant|>` | an assistant turn begins (generation starts after it)                 |
| 5  | `<|end|>`       | the current turn ends                                                 |

Chat layout (`format_chat` / `encode_chat`):

    <|bos|><|user|>{user text}<|end|><|assistant|>{assistant text}<|end|>...<|eos|>

and with `add_generation_prompt=True` the sequence ends in `<|assistant|>` instead of `<|eos|>`.

Training: the train split of every domain, one document at a time; conversational documents contribute
their turn texts (not the "User:/Assistant:" rendering), so the markers above are the only turn syntax the
vocabulary is shaped for. Training is deterministic for a given corpus and settings.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from .corpus import DOMAINS, read_split

BOS, EOS, PAD, USER, ASSISTANT, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, END)
ROLE_TOKENS = {"user": USER, "assistant": ASSISTANT}
MIN_VOCAB, MAX_VOCAB = 8192, 16384
CHAT_TEMPLATE = (  # the same layout for transformers' apply_chat_template
    "{{ '<|bos|>' }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ '<|eos|>' }}{% endif %}"
)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with the pipeline described in the module docstring."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def iter_training_texts(corpus_dir: str | Path, split: str = "train",
                        domains: Sequence[str] = DOMAINS) -> Iterator[str]:
    """Texts the tokenizer learns from: document text, or each turn's text for conversational documents."""
    for domain in domains:
        path = Path(corpus_dir) / f"{domain}.{split}.jsonl"
        if not path.exists():
            continue
        for rec in read_split(corpus_dir, domain, split):
            if rec.get("turns"):
                yield from (text for _, text in rec["turns"])
            else:
                yield rec["text"]


def train_tokenizer(corpus_dir: str | Path, out_dir: str | Path | None = None, vocab_size: int = MIN_VOCAB,
                    min_frequency: int = 2, progress: bool = True, texts: Iterable[str] | None = None,
                    check_vocab: bool = True) -> Tokenizer:
    """Train on the corpus's train split (or on `texts`) and, with `out_dir`, save tokenizer.json there.

    `check_vocab=False` allows a vocabulary outside 8K-16K (tests train tiny ones on a fixture).
    """
    if check_vocab and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is outside {MIN_VOCAB}..{MAX_VOCAB}")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts if texts is not None else iter_training_texts(corpus_dir), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    if out_dir is not None:
        save_tokenizer(tok, out_dir)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> Path:
    """tokenizer.json plus a tokenizer_config.json that lets transformers' AutoTokenizer load the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [USER, ASSISTANT, END],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out / "tokenizer.json"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json, given the file or the folder holding it; checks the special-token ids."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise ValueError(f"{path}: special token {t} has id {tok.token_to_id(t)}, expected {i}")
    return tok


def _check_turns(turns: Sequence[tuple[str, str]]):
    for role, _ in turns:
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(ROLE_TOKENS)}")


def format_chat(turns: Sequence[tuple[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat layout as a string (for display and for transformers' template; encode with `encode_chat`)."""
    _check_turns(turns)
    body = "".join(f"{ROLE_TOKENS[role]}{text}{END}" for role, text in turns)
    return BOS + body + (ASSISTANT if add_generation_prompt else EOS)


def encode_chat(turns: Sequence[tuple[str, str]], tokenizer: Tokenizer, add_generation_prompt: bool = False,
                return_roles: bool = False) -> list[int] | tuple[list[int], list[str]]:
    """Token ids of a list of (role, text) turns in the chat layout.

    Turn texts are encoded with `encode_special_tokens`, so text that contains a marker such as "<|end|>" is
    encoded as plain text (no marker injection). With `return_roles`, also return per token the role whose turn it
    belongs to ("user", "assistant", or "" for bos/eos), e.g. to train only on assistant tokens; a turn's
    opening marker belongs to "" and its `<|end|>` to the turn.
    """
    _check_turns(turns)
    ids, roles = [tokenizer.token_to_id(BOS)], [""]
    literal = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True  # marker-like text inside a turn is split like any other text
    try:
        pieces = [tokenizer.encode(text, add_special_tokens=False).ids for _, text in turns]
    finally:
        tokenizer.encode_special_tokens = literal
    for (role, _), piece in zip(turns, pieces):
        ids += [tokenizer.token_to_id(ROLE_TOKENS[role])] + piece + [tokenizer.token_to_id(END)]
        roles += [""] + [role] * (len(piece) + 1)
    ids.append(tokenizer.token_to_id(ASSISTANT if add_generation_prompt else EOS))
    roles.append("")
    return (ids, roles) if return_roles else ids


def corpus_stats(tok: Tokenizer, corpus_dir: str | Path, splits: Sequence[str] = ("train", "valid"),
                 progress: bool = True, batch: int = 512) -> dict:
    """Documents, characters and tokens (of each record's `text`) per domain and split."""
    rows = []
    for split in splits:
        for domain in DOMAINS:
            path = Path(corpus_dir) / f"{domain}.{split}.jsonl"
            if not path.exists():
                continue
            docs = chars = tokens = 0
            buf: list[str] = []

            def flush():
                nonlocal tokens
                tokens += sum(len(e.ids) for e in tok.encode_batch(buf, add_special_tokens=False))
                buf.clear()

            for rec in tqdm(read_split(corpus_dir, domain, split), desc=f"count {domain}.{split}",
                            unit="doc", disable=not progress, leave=False):
                docs += 1
                chars += len(rec["text"])
                buf.append(rec["text"])
                if len(buf) >= batch:
                    flush()
            flush()
            rows.append({"domain": domain, "split": split, "documents": docs, "chars": chars, "tokens": tokens,
                         "chars_per_token": chars / tokens if tokens else 0.0})
    return {"vocab_size": tok.get_vocab_size(), "special_tokens": list(SPECIAL_TOKENS), "rows": rows}
