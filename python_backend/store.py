"""Conversation state on disk, one record per conversation, shared by every model process of a server.

Records are the transfer codec's bytes, written atomically (temp file + rename), so a server restart loses no
conversation that was idle. A turn holds an exclusive lock file from prefill to the end of decode: a second turn
on the same conversation is refused with a clear error, never interleaved. A lock is stale, and taken over, when it
is older than `stale_lock_s` or was written by an earlier run of the server (the launcher gives each run an id that
every model process of the run sees): a turn cut off by a crash or restart does not block its conversation. Idle
records expire, and stale locks are swept with them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from ced.config import CEDConfig
from ced.state import ConversationState

from .launcher import RUN_VARIABLE
from .transfer import TransferError, decode_state, encode_state

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class StoreError(ValueError):
    pass


class ConversationBusy(StoreError):
    pass


class UnknownConversation(StoreError):
    pass


def check_id(conversation_id: str) -> str:
    if not isinstance(conversation_id, str) or not _ID.match(conversation_id) or conversation_id.startswith("."):
        raise StoreError(f"conversation_id {conversation_id!r} must be 1-128 characters of letters, digits, "
                         "'_', '-', '.', ':' (not starting with '.')")
    return conversation_id


class ConversationStore:
    def __init__(self, root: str | Path, config: CEDConfig, idle_timeout_s: float = 3600.0,
                 stale_lock_s: float = 600.0, run_id: str | None = None):
        self.root, self.config = Path(root), config
        self.idle_timeout_s, self.stale_lock_s = idle_timeout_s, stale_lock_s
        self.run_id = os.environ.get(RUN_VARIABLE, "") if run_id is None else run_id  # "" when not started by us
        self.root.mkdir(parents=True, exist_ok=True)

    def _record(self, conversation_id: str) -> Path:
        return self.root / f"{check_id(conversation_id)}.state"

    def _lock(self, conversation_id: str) -> Path:
        return self.root / f"{check_id(conversation_id)}.lock"

    # -- records --------------------------------------------------------------------------------------------

    def exists(self, conversation_id: str) -> bool:
        return self._record(conversation_id).is_file()

    def load(self, conversation_id: str) -> ConversationState:
        path = self._record(conversation_id)
        if not path.is_file():
            raise UnknownConversation(f"unknown conversation_id {conversation_id!r} (ended, expired or never started)")
        try:
            return decode_state(path.read_bytes(), self.config)
        except TransferError as error:
            path.unlink(missing_ok=True)
            log.error("dropped the damaged record of conversation %s: %s", conversation_id, error)
            raise StoreError(f"the stored state of conversation {conversation_id!r} was damaged and has been "
                             f"dropped: {error}") from None

    def save(self, conversation_id: str, state: ConversationState) -> None:
        path = self._record(conversation_id)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_bytes(encode_state(state, self.config))
        os.replace(temporary, path)

    def delete(self, conversation_id: str) -> bool:
        path = self._record(conversation_id)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    def conversations(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.state"))

    def expire(self, now: float | None = None) -> list[str]:
        """Delete records idle longer than the timeout (never one with a live turn) and stale lock files."""
        now, expired = time.time() if now is None else now, []
        for lock in self.root.glob("*.lock"):
            if self._stale(lock, now):
                lock.unlink(missing_ok=True)
        for conversation_id in self.conversations():
            path = self._record(conversation_id)
            try:
                idle = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
            if idle > self.idle_timeout_s and not self._lock(conversation_id).exists():
                path.unlink(missing_ok=True)
                expired.append(conversation_id)
        return expired

    # -- one turn at a time ---------------------------------------------------------------------------------

    def _stale(self, lock: Path, now: float) -> bool:
        """A lock of a turn that died without ending: too old, or from an earlier run of the server."""
        try:
            if now - lock.stat().st_mtime > self.stale_lock_s:
                return True
            return bool(self.run_id) and lock.read_text().split()[0] != self.run_id
        except (FileNotFoundError, IndexError):  # gone meanwhile, or caught between create and write
            return False

    def begin_turn(self, conversation_id: str) -> None:
        lock = self._lock(conversation_id)
        try:
            if self._stale(lock, time.time()):
                lock.unlink(missing_ok=True)
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise ConversationBusy(f"conversation {conversation_id!r} already has a turn in progress; "
                                   "send the next turn after this one's answer") from None
        os.write(descriptor, f"{self.run_id or '-'} {os.getpid()}".encode())
        os.close(descriptor)

    def end_turn(self, conversation_id: str) -> None:
        self._lock(conversation_id).unlink(missing_ok=True)
