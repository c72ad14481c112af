"""API keys of `mol2 serve` (--api-key, --api-key-file, MOL2_API_KEY): what the OpenAI port and the guarded Triton
HTTP port ask of a request, `Authorization: Bearer KEY`. No key configured: every request passes, as before.

A key is checked against every configured key, each comparison in constant time over SHA-256 digests (equal
lengths, so not even a key's length shows in the timing), and without stopping at the first match.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

ENV_VARIABLE = "MOL2_API_KEY"
CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 6750: what a 401 tells the client to send


class ApiKeyError(ValueError):
    """A key source that cannot be used (an unreadable or empty file, a blank key)."""


@dataclass(frozen=True)
class ApiKeys:
    digests: tuple[bytes, ...] = ()  # SHA-256 of each key; the keys themselves are not kept

    @classmethod
    def of(cls, keys) -> "ApiKeys":
        keys = list(keys)
        if any(not key.strip() or key != key.strip() for key in keys):
            raise ApiKeyError("an API key must not be empty or begin or end with white space")
        return cls(tuple(hashlib.sha256(key.encode("utf-8")).digest() for key in dict.fromkeys(keys)))

    @classmethod
    def load(cls, keys=(), key_file: str | Path | None = None, environment: str | None = None) -> "ApiKeys":
        """--api-key values, the lines of --api-key-file (blank lines and lines starting with # skipped) and
        MOL2_API_KEY, together."""
        found = list(keys or ())
        if key_file is not None:
            try:
                lines = Path(key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ApiKeyError(f"--api-key-file {key_file} cannot be read: {error}") from None
            from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not from_file:
                raise ApiKeyError(f"--api-key-file {key_file} holds no key (one key per line)")
            found += from_file
        if environment:
            found.append(environment.strip())
        return cls.of(found)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def __len__(self) -> int:
        return len(self.digests)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header carries one of the keys (`Bearer KEY`, the scheme in any case)."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            key = ""
        given = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).digest()
        matched = False
        for digest in self.digests:  # every key, no early exit
            matched |= hmac.compare_digest(given, digest)
        return matched and bool(key.strip())

    @staticmethod
    def problem(authorization: str | None) -> str:
        """What a refused request is told."""
        if not authorization:
            return "this server needs an API key: send it as the header 'Authorization: Bearer KEY'"
        if authorization.partition(" ")[0].lower() != "bearer":
            return "the Authorization header must be 'Bearer KEY'"
        return "the API key is not valid"


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything
