"""Conversation state on disk, one append-only journal per conversation, shared by every model process of a server.

`<id>.state` holds the records of python_backend/journal.py: a snapshot, then one delta per turn (what the turn
added: O(new tokens + W) bytes, not the whole state). When dead bytes (replaced windows) make the file more than
twice a snapshot's size plus a slack, it is rewritten as one snapshot (temp file + rename), so the bytes written
per turn stay O(new tokens + W) amortised. A kill mid-write leaves a truncated tail: the next load replays the good
records (the conversation is back at its last good turn), moves the bad tail to `quarantine/` and cuts it off; a
journal with no good record at all is dropped. A server restart therefore loses no conversation that was idle.

A turn holds an exclusive lock file from prefill to the end of decode: a second turn on the same conversation is
refused with a clear error, never interleaved, and only the turn holding the lock writes the journal. A lock is
stale, and taken over, when it is older than `stale_lock_s` or was written by an earlier run of the server (the
launcher gives each run an id that every model process of the run sees): a turn cut off by a crash or restart does
not block its conversation. Idle records expire, and stale locks are swept with them.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ced.config import CEDConfig
from ced.state import ConversationState

from .journal import StateDelta, apply_delta, delta_of, empty_state, encode_record, journal_length, read_journal
from .launcher import RUN_VARIABLE

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
QUARANTINE = "quarantine"


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


@dataclass(frozen=True)
class _Journal:
    """What this process knows of a journal file, valid while the file keeps this size and inode."""

    size: int
    inode: int
    length: int  # tokens the journal holds
    added: int  # bytes of its tokens and global entries, summed over the records
    replaced: int  # bytes of the W-bounded parts of its last record (the earlier copies are dead)


class ConversationStore:
    def __init__(self, root: str | Path, config: CEDConfig, idle_timeout_s: float = 3600.0,
                 stale_lock_s: float = 600.0, run_id: str | None = None, compact_slack: int = 1 << 20):
        self.root, self.config = Path(root), config
        self.idle_timeout_s, self.stale_lock_s = idle_timeout_s, stale_lock_s
        self.run_id = os.environ.get(RUN_VARIABLE, "") if run_id is None else run_id  # "" when not started by us
        self._held: set[str] = set()  # the turns this store began (its own lock does not mean "being written")
        self.compact_slack = compact_slack  # bytes a journal may exceed twice its live state by before compaction
        self.bytes_written = 0  # journal bytes this process wrote (appends and snapshots)
        self.last_write_bytes = 0  # bytes of the last save/append/compact
        self._journals: dict[str, _Journal] = {}
        self.root.mkdir(parents=True, exist_ok=True)

    def _record(self, conversation_id: str) -> Path:
        return self.root / f"{check_id(conversation_id)}.state"

    def _lock(self, conversation_id: str) -> Path:
        return self.root / f"{check_id(conversation_id)}.lock"

    # -- records --------------------------------------------------------------------------------------------

    def exists(self, conversation_id: str) -> bool:
        return self._record(conversation_id).is_file()

    def load(self, conversation_id: str) -> ConversationState:
        """The conversation at its last good turn. While another turn holds the lock, its record may be half
        written: the file is then left alone (that turn repairs it, or the next load after it)."""
        try:
            deltas, problem, clean = self._read(conversation_id, repair=not self._turn_running(conversation_id))
        except FileNotFoundError:
            raise UnknownConversation(f"unknown conversation_id {conversation_id!r} (ended, expired or never "
                                      "started)") from None
        if not deltas:
            if not clean:
                raise ConversationBusy(f"conversation {conversation_id!r} is being written by a turn in progress; "
                                       "send the next turn after this one's answer")
            raise StoreError(f"the stored state of conversation {conversation_id!r} was damaged and has been "
                             f"dropped: {problem}")
        state = empty_state(self.config)
        for delta in deltas:
            apply_delta(state, delta)
        return state

    def save(self, conversation_id: str, state: ConversationState) -> None:
        """Append what `state` holds beyond the stored journal; a state shorter than the journal replaces it."""
        journal = self._journal(conversation_id)
        if journal is None or state.length < journal.length:
            self._write_snapshot(conversation_id, delta_of(state, 0))
        else:
            self._append(conversation_id, journal, delta_of(state, journal.length), state)

    def append(self, conversation_id: str, delta: StateDelta,
               snapshot: Callable[[], StateDelta] | None = None) -> None:
        """Append a delta taken elsewhere (journal.delta_of); it must start where the journal ends. A snapshot
        (start_length 0) replaces the journal. `snapshot` gives the whole state when compaction is due (the
        resident pool has it: no read of the journal back)."""
        journal = self._journal(conversation_id)
        if delta.start_length == 0:
            self._write_snapshot(conversation_id, delta)
        elif journal is None or delta.start_length != journal.length:
            raise StoreError(f"the delta for conversation {conversation_id!r} starts at token {delta.start_length}, "
                             f"its journal holds {0 if journal is None else journal.length}")
        else:
            self._append(conversation_id, journal, delta, None, snapshot)

    def compact(self, conversation_id: str) -> None:
        """Rewrite the journal as one snapshot of the state it holds."""
        self._write_snapshot(conversation_id, delta_of(self.load(conversation_id), 0))

    def length_of(self, conversation_id: str) -> int | None:
        """Tokens the journal holds, from the cache or its record headers (no tensor is read); None if absent."""
        journal = self._cached(conversation_id)
        if journal is not None:
            return journal.length
        try:
            with open(self._record(conversation_id), "rb") as file:
                return journal_length(file)
        except FileNotFoundError:
            return None

    def journal_size(self, conversation_id: str) -> int:
        try:
            return self._record(conversation_id).stat().st_size
        except FileNotFoundError:
            return 0

    def delete(self, conversation_id: str) -> bool:
        path = self._record(conversation_id)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        self._journals.pop(conversation_id, None)
        return existed

    def conversations(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.state"))  # not recursive: quarantine/ is not listed

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
                self._journals.pop(conversation_id, None)
                expired.append(conversation_id)
        return expired

    # -- the journal file -----------------------------------------------------------------------------------

    def _cached(self, conversation_id: str) -> _Journal | None:
        """This process's view of the journal, if no other process has written it since."""
        journal = self._journals.get(conversation_id)
        try:
            stat = self._record(conversation_id).stat()
        except FileNotFoundError:
            self._journals.pop(conversation_id, None)
            return None
        return journal if journal is not None and (journal.size, journal.inode) == (stat.st_size, stat.st_ino) \
            else None

    def _journal(self, conversation_id: str) -> _Journal | None:
        """The journal a writer appends to (None: none yet), read and repaired when the cache is stale. Only the
        turn holding the lock writes, so repairing here cannot cut off another writer's record."""
        journal = self._cached(conversation_id)
        if journal is None:
            try:
                self._read(conversation_id, repair=True)
            except FileNotFoundError:
                return None
            journal = self._journals.get(conversation_id)
        return journal

    def _read(self, conversation_id: str, repair: bool) -> tuple[list[StateDelta], str | None, bool]:
        """The journal's good records, its first problem, and whether the file now holds exactly the good records
        (with `repair`, a bad tail is moved to quarantine and cut off; no good record: the file is moved there)."""
        path = self._record(conversation_id)
        with open(path, "rb") as file:
            inode, data = os.fstat(file.fileno()).st_ino, file.read()
        deltas, good, problem = read_journal(data, self.config)
        clean = problem is None or (repair and self._quarantine(conversation_id, path, inode, data, good, problem))
        self._journals.pop(conversation_id, None)
        if clean and deltas:
            self._journals[conversation_id] = _Journal(good, inode, deltas[-1].end_length,
                                                       sum(d.added_nbytes() for d in deltas),
                                                       deltas[-1].replaced_nbytes())
        return deltas, problem, clean

    def _quarantine(self, conversation_id: str, path: Path, inode: int, data: bytes, good: int, problem: str) -> bool:
        """Move the bytes after `good` aside and cut the journal back to them; False if the file changed since
        `data` was read (someone else wrote it: nothing is cut)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        if (stat.st_size, stat.st_ino) != (len(data), inode):
            return False
        folder = self.root / QUARANTINE
        folder.mkdir(exist_ok=True)
        target = folder / f"{conversation_id}.{time.time_ns()}.tail"
        if good == 0:
            os.replace(path, target)
            log.error("conversation %s: %s; no turn of its journal is readable, moved to %s", conversation_id,
                      problem, target)
        else:
            target.write_bytes(data[good:])  # kept first: a crash between the two steps loses nothing
            os.truncate(path, good)
            log.error("conversation %s: %s; back at its last good turn (%d bytes), the %d-byte tail moved to %s",
                      conversation_id, problem, good, len(data) - good, target)
        return True

    def _append(self, conversation_id: str, journal: _Journal, delta: StateDelta,
                state: ConversationState | None, snapshot: Callable[[], StateDelta] | None = None) -> None:
        record = encode_record(delta, self.config)
        added, replaced = journal.added + delta.added_nbytes(), delta.replaced_nbytes()
        # added + replaced: the bytes of the live state, what a snapshot of it holds; the rest is dead copies
        if journal.size + len(record) > 2 * (added + replaced) + self.compact_slack:
            if state is not None:
                self._write_snapshot(conversation_id, delta_of(state, 0))
            elif snapshot is not None:
                self._write_snapshot(conversation_id, snapshot())
            else:  # a delta from elsewhere: the journal's state plus it
                state = self.load(conversation_id)
                apply_delta(state, delta)
                self._write_snapshot(conversation_id, delta_of(state, 0))
            return
        # One write on an O_APPEND descriptor: it goes straight to the page cache, where every other process
        # reads it (no user-space buffer to flush; durability against a power cut is not asked for, so no fsync).
        descriptor = os.open(self._record(conversation_id), os.O_WRONLY | os.O_APPEND)
        try:
            written = os.write(descriptor, record)
            while written < len(record):  # a short write (a signal, a full disk) continues where it stopped
                written += os.write(descriptor, memoryview(record)[written:])
            stat = os.fstat(descriptor)
        finally:
            os.close(descriptor)
        self._count(len(record))
        if stat.st_size == journal.size + len(record):
            self._journals[conversation_id] = _Journal(stat.st_size, stat.st_ino, delta.end_length, added, replaced)
        else:  # another process wrote meanwhile: read the file again next time
            self._journals.pop(conversation_id, None)

    def _write_snapshot(self, conversation_id: str, delta: StateDelta) -> None:
        path, record = self._record(conversation_id), encode_record(delta, self.config)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_bytes(record)
        stat = temporary.stat()  # the inode keeps through the rename
        os.replace(temporary, path)  # readers see the old journal or the new one, never a mix
        self._count(len(record))
        self._journals[conversation_id] = _Journal(stat.st_size, stat.st_ino, delta.end_length, delta.added_nbytes(),
                                                   delta.replaced_nbytes())

    def _count(self, written: int) -> None:
        self.bytes_written += written
        self.last_write_bytes = written

    def _turn_running(self, conversation_id: str) -> bool:
        """Another turn (not one this store began) holds the lock."""
        if conversation_id in self._held:
            return False
        lock = self._lock(conversation_id)
        return lock.exists() and not self._stale(lock, time.time())

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
        self._held.add(conversation_id)

    def end_turn(self, conversation_id: str) -> None:
        self._held.discard(conversation_id)
        self._lock(conversation_id).unlink(missing_ok=True)
