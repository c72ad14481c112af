"""Seals on internal inputs: a seal checks only for exactly the fields and the secret it was made with; the
secret file is made 0600 and refused when others can read it; a server without a secret refuses every check."""

import os

import numpy as np
import pytest

from python_backend.core.seal import (DECODE, PREFILL, RETURNED, SECRET_VARIABLE, SealError, Sealer, create_secret_file,
                                 decode_fields, prefill_fields, read_secret, returned_fields)

STATE = b"some state bytes"


def test_a_seal_checks_only_for_its_own_fields_purpose_and_secret():
    sealer = Sealer(bytes(range(32)))
    fields = decode_fields("c1", 12, 7, STATE, True, False)
    seal = sealer.seal(DECODE, **fields)
    sealer.check(DECODE, seal, **fields)
    changed = [decode_fields("c2", 12, 7, STATE, True, False), decode_fields("c1", 13, 7, STATE, True, False),
               decode_fields("c1", 12, 8, STATE, True, False), decode_fields("c1", 12, 7, STATE + b"!", True, False),
               decode_fields("c1", 12, 7, STATE, False, False), decode_fields("c1", 12, 7, STATE, True, True)]
    for other in changed:
        with pytest.raises(SealError, match="does not match"):
            sealer.check(DECODE, seal, **other)
    with pytest.raises(SealError, match="does not match"):  # the same fields under another purpose
        sealer.check(RETURNED, sealer.seal(RETURNED, **returned_fields("c1", STATE)), **returned_fields("c2", STATE))
    with pytest.raises(SealError, match="does not match"):
        Sealer(bytes(32)).check(DECODE, seal, **fields)
    for missing in (None, ""):
        with pytest.raises(SealError, match="internal stage"):
            sealer.check(DECODE, missing, **fields)
    for garbage in ("\u00e9" * 64, "\ud800", "ab" * 32, seal.upper()):  # non-ASCII and lone surrogates too
        with pytest.raises(SealError, match="does not match"):
            sealer.check(DECODE, garbage, **fields)


def test_prefill_seals_cover_the_conversation_the_turn_and_route_only():
    sealer = Sealer(bytes(range(32)))
    ids = np.array([5, 6, 7], dtype=np.int64)
    seal = sealer.seal(PREFILL, **prefill_fields("c1", False, ids))
    sealer.check(PREFILL, seal, **prefill_fields("c1", False, [5, 6, 7]))  # the ids' dtype does not matter
    for other in (prefill_fields("c2", False, ids), prefill_fields(None, False, ids), prefill_fields("c1", True, ids),
                  prefill_fields("c1", False, ids[:2])):
        with pytest.raises(SealError):
            sealer.check(PREFILL, seal, **other)


def test_the_secret_file(tmp_path, monkeypatch):
    path = create_secret_file(tmp_path / "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    secret = read_secret(path)
    assert len(secret) == 32
    assert create_secret_file(path) == path and read_secret(path) == secret  # kept: the pair's second server
    assert read_secret(create_secret_file(path, replace=True)) != secret  # a fresh start: a new one
    os.chmod(path, 0o644)
    with pytest.raises(SealError, match="readable by others"):
        read_secret(path)
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(SealError, match="fewer than 32"):
        read_secret(short)

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    unset = Sealer.from_environment()
    with pytest.raises(SealError, match="without a secret"):
        unset.check(DECODE, "00", **decode_fields("c1", 1, 0, STATE, True, False))
    with pytest.raises(SealError, match="without a secret"):
        unset.seal(PREFILL, **prefill_fields("c1", False, [1]))
    monkeypatch.setenv(SECRET_VARIABLE, str(path))  # mode 644: refused, every check fails saying so
    with pytest.raises(SealError, match="readable by others"):
        Sealer.from_environment().check(DECODE, "00", **decode_fields("c1", 1, 0, STATE, True, False))
