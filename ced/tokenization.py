"""A model's chat tokenizer: the trained BPE (`tokenizer.json` beside the weights) with its chat markers, or UTF-8
bytes for the untrained demo. A user turn is wrapped the way the model was trained on dialogues."""

from __future__ import annotations

from pathlib import Path



class ByteTokenizer:
    """UTF-8 bytes as token ids: the stand-in when a model has no trained tokenizer."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            self._bpe, self._bytes = Tokenizer.from_file(str(path)), None
            ids = {name: self._bpe.token_to_id(name) for name in ("<|bos|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                                  "<|eos|>")}
            self.bos, self.user, self.assistant = ids["<|bos|>"], ids["<|user|>"], ids["<|assistant|>"]
            self.stop_ids = tuple(i for i in (ids["<|end|>"], ids["<|eos|>"]) if i is not None)
        else:
            self._bpe, self._bytes = None, ByteTokenizer()
            self.bos = self.user = self.assistant = None
            self.stop_ids = ()

    @property
    def trained(self) -> bool:
        return self._bpe is not None

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode(text).ids if self._bpe else self._bytes.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._bpe.decode(ids, skip_special_tokens=True) if self._bpe else self._bytes.decode(ids)

    def user_turn(self, text_ids: list[int], first: bool) -> list[int]:
        """`<|bos|>` on the first turn, then `<|user|>text<|end|><|assistant|>`: the reply starts right after."""
        if not self.trained:
            return list(text_ids)
        return ([self.bos] if first else []) + [self.user] + list(text_ids) + [self.stop_ids[0], self.assistant]
