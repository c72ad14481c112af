"""The adapter id that crosses process boundaries: a 31-bit FNV-1a hash of the adapter's path, 0 for the base.

Names and slots are per process; a path is what both sides of a transfer agree on (docs/architecture.md §2).
"""

from __future__ import annotations

FNV_OFFSET, FNV_PRIME = 0x811C9DC5, 0x01000193
BASE = 0


def adapter_hash(path: str | None) -> int:
    """FNV-1a (32-bit) of the UTF-8 path, folded to 31 bits; never 0 for a real path (0 means no adapter)."""
    if path is None:
        return BASE
    value = FNV_OFFSET
    for byte in str(path).encode("utf-8"):
        value = ((value ^ byte) * FNV_PRIME) & 0xFFFFFFFF
    value &= 0x7FFFFFFF
    return value or 1
