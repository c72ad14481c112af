"""Seals on internal inputs: a direct call to an internal model cannot lock, unlock, read or write a conversation.

The split stages (`prefill`, `decode`) take inputs prefixed `_` that name a conversation and carry its state: the
relay of a disaggregated prefill server and the `route` model send them through BLS, the relay sends decode's over
gRPC to the decode server, and decode sends the final state back. Triton serves those models on the same ports as
the public ones, so whoever calls them must prove it is one of this server's own stages: it seals the request with
an HMAC-SHA256, under a secret the server makes at start, over the fields that name the conversation and what is
asked of it (the conversation id, the transfer metadata, a sha256 of the state bytes, route-only, return-state,
end-of-conversation). The stage checks the seal before it touches the store; a missing or wrong one is refused
with a 400. The state decode hands back is sealed the same way, and the relay stores only a state whose seal
checks out. A relay's token link to decode (the stream its turns' tokens come on) is opened with a seal over its
id, and each turn's seal names the link and the turn's number on it.

The secret: 32 random bytes, hex, in a file only its owner may read (0600). `mol2 serve` writes a fresh one at
every start under its work folder, or takes `--secret-file PATH` (created when missing); the file's path reaches
every model process in MOL2_SECRET_FILE. The two servers of a disaggregated pair must be given the same file.

Seals never leave the servers (no public output carries one), so a client has none to replay. Between the two
servers of a pair they travel over gRPC with the state, in the clear like it: keep that link private, as any gRPC.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

import numpy as np

SECRET_VARIABLE = "MOL2_SECRET_FILE"
SECRET_BYTES = 32
_VERSION = "s1"


class SealError(ValueError):
    """An internal input without a valid seal: refused (400) before anything is read or written."""


def create_secret_file(path: str | Path, replace: bool = False) -> Path:
    """A 0600 file holding a new secret (`replace`: always a new one; else only when the file is missing, so the
    second server of a pair reads the secret the first one wrote). Returns the path, checked readable."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    if replace:
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.unlink(missing_ok=True)
        _write_new(temporary)
        os.replace(temporary, path)  # a model process reading it sees the old secret or the new one, never half
    else:
        try:
            _write_new(path)
        except FileExistsError:
            pass
    read_secret(path)
    return path


def _write_new(path: Path) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    try:
        os.write(descriptor, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
    finally:
        os.close(descriptor)


def read_secret(path: str | Path) -> bytes:
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as error:
        raise SealError(f"cannot read the server secret {path}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SealError(f"the server secret {path} is readable by others (mode {stat.S_IMODE(mode):o}): "
                        f"chmod 600 {path}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SealError(f"the server secret {path} must hold hex digits (as mol2 serve writes it)") from None
    if len(secret) < SECRET_BYTES:
        raise SealError(f"the server secret {path} holds {len(secret)} bytes, fewer than {SECRET_BYTES}")
    return secret


def digest(data: bytes) -> str:
    """sha256 of a state's bytes: what a seal covers instead of the bytes themselves."""
    return hashlib.sha256(data).hexdigest()


def ids_digest(ids) -> str:
    """The same for token ids, whatever integer dtype or shape they came in."""
    return digest(np.asarray(ids, dtype=np.int64).reshape(-1).tobytes())


def _encode(purpose: str, fields: dict) -> bytes:
    """Every field as name, type and value, length-prefixed: no two different requests encode alike."""
    parts = [_VERSION, purpose]
    for name in sorted(fields):
        value = fields[name]
        if isinstance(value, bytes):
            value = value.hex()
        elif not isinstance(value, (str, int, bool, type(None))):
            raise TypeError(f"cannot seal field {name!r} of type {type(value).__name__}")
        parts += [name, type(value).__name__, str(value)]
    encoded = [part.encode("utf-8", "surrogatepass") for part in parts]  # any text, lone surrogates too
    return b"".join(len(part).to_bytes(4, "little") + part for part in encoded)


class Sealer:
    """Seals and checks with the server's secret. Without one (MOL2_SECRET_FILE unset, e.g. a tritonserver started
    by hand) it seals nothing and every check fails, saying why: internal stages then refuse all calls."""

    def __init__(self, secret: bytes | None, problem: str = ""):
        self.secret, self.problem = secret, problem

    @classmethod
    def from_environment(cls) -> "Sealer":
        path = os.environ.get(SECRET_VARIABLE)
        if not path:
            return cls(None, f"this server was started without a secret ({SECRET_VARIABLE} is not set; mol2 serve "
                             "sets it)")
        try:
            return cls(read_secret(path))
        except SealError as error:
            return cls(None, str(error))

    def seal(self, purpose: str, **fields) -> str:
        if self.secret is None:
            raise SealError(f"cannot call an internal stage: {self.problem}")
        return hmac.new(self.secret, _encode(purpose, fields), hashlib.sha256).hexdigest()

    def check(self, purpose: str, seal: str | None, **fields) -> None:
        """Raises SealError unless `seal` is this secret's seal of exactly these fields."""
        if self.secret is None:
            raise SealError(f"{purpose}: internal input refused: {self.problem}")
        if not seal:
            raise SealError(f"{purpose} is an internal stage: it is called by this server's own models, with a "
                            "sealed `_seal` input; a request without one is refused")
        given = seal.encode("utf-8", "surrogatepass")  # bytes: compare_digest refuses non-ASCII text
        if not hmac.compare_digest(self.seal(purpose, **fields).encode(), given):
            raise SealError(f"{purpose}: the `_seal` input does not match the request (not sealed by this server, "
                            "or sealed for other inputs; the two servers of a disaggregated pair must share one "
                            "--secret-file)")


# -- what each internal stage's seal covers ----------------------------------------------------------------------

# the purposes: a seal for one is no seal for another
PREFILL, DECODE, RETURNED, LINK = "prefill", "decode", "decoded", "link"


def prefill_fields(conversation_id: str | None, route_only: bool, text_ids, route_start: int | None = None) -> dict:
    """A prefill request: which conversation ("": a new one), whether it may lock and write it, the turn's ids;
    `route_start` set: the ids are a whole stateless prompt (no conversation), the router's turn starting there."""
    return {"conversation_id": conversation_id or "", "route_only": bool(route_only), "text_ids": ids_digest(text_ids),
            "stateless_route_start": -1 if route_start is None else int(route_start)}


def decode_fields(conversation_id: str, length: int, adapter_hash: int, state: bytes, return_state: bool,
                  end_conversation: bool, link: int = 0, link_turn: int = 0) -> dict:
    """A decode request: the conversation, its transfer metadata and state, and what decode does with the result
    (where its tokens go: on a relay's token link, `link` and the turn's number on it; 0: its own stream)."""
    return {"conversation_id": conversation_id, "length": int(length), "adapter_hash": int(adapter_hash),
            "state": digest(state), "return_state": bool(return_state), "end_conversation": bool(end_conversation),
            "link": int(link), "link_turn": int(link_turn)}


def link_fields(link: int) -> dict:
    """A relay's token link to decode: whoever opens one receives the tokens of the turns that name it."""
    return {"link": int(link)}


def returned_fields(conversation_id: str, state: bytes) -> dict:
    """The final state decode hands back to the prefill server that owns the store."""
    return {"conversation_id": conversation_id, "state": digest(state)}
