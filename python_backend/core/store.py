"""Conversation state on disk, one append-only journal per conversation, shared by every model process of a server.

`<id>.state` holds the records of python_backend/core/journal.py: a snapshot, then one delta per turn (what the turn
added: O(new tokens + W) bytes, not the whole state). When dead bytes (replaced windows) make the file more than
twice a snapshot's size plus a slack, it is rewritten as one snapshot (temp file + rename), so the bytes written
per turn stay O(new tokens + W) amortised. A kill mid-write leaves a truncated tail: the next load replays the good
records (the conversation is back at its last good turn, which the cut-off turn never got past: it was not
answered), moves the bad tail to `quarantine/` and cuts it off. Damage to a complete record (a flipped byte, a file
replaced) loses turns that were answered: the load that finds it repairs the journal the same way, then refuses
with ConversationReset, naming what it found and the turn the conversation is back at. A journal with no good
record at all is dropped. A server restart therefore loses no conversation that was idle.

The journal is trusted only while it is what this process wrote. Each write remembers the file (inode, size,
modification and change times) and the digests of its records; before a turn is appended, the file is checked
against that (one stat, and its last record read and checked again: O(new tokens + W)). A journal damaged since
is never appended to: the caller's whole state (the engine's resident copy, which is what was written) replaces it
as a snapshot, the damaged file kept in quarantine/, and no turn is lost (`reusable`, and the writes). A journal
whose records all check out but are not ours was written by another process: it is read back, never overwritten.
A failed write (a full disk) leaves the journal as it was and no file behind (no temp file, no quarantine copy).

A turn holds an exclusive OS lock (flock) on `<id>.lock` from its start to the end of decode: a second turn on
the same conversation, from this process or any other (another model process, another server on the same store),
is refused with a clear error, never interleaved, and only the turn holding the lock writes the journal. The kernel
releases the lock when its process dies, so a turn cut off by a crash or a kill never blocks its conversation; the
lock file it leaves is swept by `expire`. Idle records expire (never one whose lock is held).

A server holds the whole store with `hold_store` (`mol2 serve` does, for its life): a second server started on a
store that a live one holds is refused, with the holder named. Limits (python_backend/core/limits.py): a new
conversation is refused when the store is at `max_conversations` or `max_store_bytes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ced.config import CEDConfig
from ced.families import family_of_config
from ced.state import ConversationState, StateDelta

from .journal import DIGEST_SIZE, JournalError, JournalScan, encode_record, journal_length, read_journal, record_digest
from .limits import Limits

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
QUARANTINE = "quarantine"
OWNER = ".server.lock"  # the store-level lock (a name no conversation id can take)


class StoreError(ValueError):
    pass


class ConversationBusy(StoreError):
    pass


class UnknownConversation(StoreError):
    pass


class StoreInUse(StoreError):
    pass


class StoreDamaged(StoreError):
    """A conversation's stored state was found damaged: a server condition, not the client's mistake."""


class ConversationReset(StoreDamaged):
    """Damage cost answered turns: the conversation is back at its last good turn, and the client is told once."""


def check_id(conversation_id: str) -> str:
    if not isinstance(conversation_id, str) or not _ID.match(conversation_id) or conversation_id.startswith("."):
        raise StoreError(f"conversation_id {conversation_id!r} must be 1-128 characters of letters, digits, "
                         "'_', '-', '.', ':' (not starting with '.')")
    return conversation_id


@dataclass(frozen=True)
class _Journal:
    """What this process wrote or read of a journal file. It stands for the file while the file is the same one
    (inode), of the same size and untouched since (its modification and change times: any write moves them), and
    its last record still checks out against digests[-1]."""

    size: int
    inode: int
    times: tuple[int, int]  # st_mtime_ns, st_ctime_ns just after the write or read
    length: int  # tokens the journal holds
    added: int  # bytes of its tokens and global entries, summed over the records
    replaced: int  # bytes of the W-bounded parts of its last record (the earlier copies are dead)
    digests: tuple[bytes, ...]  # every record's digest, in order: the journal's identity
    tail: int  # where its last record starts

    def describes(self, stat: os.stat_result) -> bool:
        return (self.inode, self.size, self.times) == (stat.st_ino, stat.st_size, (stat.st_mtime_ns, stat.st_ctime_ns))


class ConversationStore:
    def __init__(self, root: str | Path, config: CEDConfig, idle_timeout_s: float = 3600.0,
                 limits: Limits = Limits(), compact_slack: int = 1 << 20):
        self.root, self.config = Path(root), config
        self.states = family_of_config(config).state_verbs()  # the family's state verbs: load, save, compact
        self.idle_timeout_s, self.limits = idle_timeout_s, limits
        self._held: dict[str, int] = {}  # the turns this store began -> the descriptor holding their flock
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
        """The conversation at its last good turn. A bad tail is repaired only under the turn lock (this store's
        turn, or the lock taken for the repair): while another turn holds it, the record may be half written and
        is left alone (that turn repairs it, or the next load after it). The load that repairs damage to complete
        records raises ConversationReset (answered turns were lost); the next load starts from there."""
        try:
            held = conversation_id in self._held
            scan, moved = self._read(conversation_id, repair=held)
            if scan.problem is not None and not held:
                descriptor = self._try_lock(conversation_id)
                if descriptor is not None:
                    try:
                        scan, moved = self._read(conversation_id, repair=True)
                    finally:
                        self._unlock(conversation_id, descriptor)
        except FileNotFoundError:
            raise UnknownConversation(f"unknown conversation_id {conversation_id!r} (ended, expired or never "
                                      "started)") from None
        if not scan.deltas:
            if scan.problem is not None and moved is None:
                raise ConversationBusy(f"conversation {conversation_id!r} is being written by a turn in progress; "
                                       "send the next turn after this one's answer")
            raise StoreDamaged(f"the stored state of conversation {conversation_id!r} was damaged and has been "
                               f"dropped: {scan.problem} (the file was moved to {moved})")
        if moved is not None and not scan.torn:
            raise ConversationReset(
                f"the stored state of conversation {conversation_id!r} was damaged ({scan.problem}); the "
                f"conversation was reset to its last good turn ({scan.deltas[-1].end_length} tokens), the damaged "
                f"records moved to {moved}: send this turn again to continue from there")
        state = self.states.empty_state(self.config)
        for delta in scan.deltas:
            self.states.apply_delta(state, delta)
        return state

    def save(self, conversation_id: str, state: ConversationState) -> None:
        """Append what `state` holds beyond the stored journal; a state shorter than the journal replaces it, and
        so does a journal damaged since this process wrote it (`state` is what it wrote, and this turn)."""
        journal, damage = self._writable(conversation_id)
        if damage is not None:
            self._rewrite(conversation_id, self.states.delta_of(state, 0), damage)
        elif journal is None or state.length < journal.length:
            self._write_snapshot(conversation_id, self.states.delta_of(state, 0))
        else:
            self._append(conversation_id, journal, self.states.delta_of(state, journal.length), state)

    def commit(self, conversation_id: str, state: ConversationState, end_conversation: bool) -> None:
        """A turn's final state becomes the conversation's one stored copy; the last turn frees it instead."""
        if end_conversation:
            self.delete(conversation_id)
        else:
            self.save(conversation_id, state)

    def append(self, conversation_id: str, delta: StateDelta,
               snapshot: Callable[[], StateDelta] | None = None) -> None:
        """Append a delta taken elsewhere (ced.state.delta_of); it must start where the journal ends. A snapshot
        (start_length 0) replaces the journal. `snapshot` gives the whole state when compaction is due, or when the
        journal was damaged since this process wrote it (the resident pool has it: no read of the journal back)."""
        if delta.start_length == 0:
            self._write_snapshot(conversation_id, delta)
            return
        journal, damage = self._writable(conversation_id)
        if damage is not None and snapshot is not None:
            self._rewrite(conversation_id, snapshot(), damage)
        elif damage is not None:
            raise StoreDamaged(f"the journal of conversation {conversation_id!r} was damaged since this server "
                               f"wrote it ({damage}) and the turn has no whole state to replace it with; the turn "
                               "was not stored")
        elif journal is None or delta.start_length != journal.length:
            raise StoreError(f"the delta for conversation {conversation_id!r} starts at token {delta.start_length}, "
                             f"its journal holds {0 if journal is None else journal.length}")
        else:
            self._append(conversation_id, journal, delta, None, snapshot)

    def compact(self, conversation_id: str) -> None:
        """Rewrite the journal as one snapshot of the state it holds."""
        self._write_snapshot(conversation_id, self.states.delta_of(self.load(conversation_id), 0))

    def identity(self, conversation_id: str) -> _Journal | None:
        """What this process last wrote or read of the journal, if the file is still that (one stat). A holder of
        the conversation's state keeps it beside the state and hands it to `reusable` at the next turn."""
        return self._cached(conversation_id)

    def reusable(self, conversation_id: str, written: _Journal | None, whole: Callable[[], StateDelta]) -> bool:
        """Whether a copy of the conversation held since the journal was `written` (identity() after its last
        turn) is still its state; call it holding the turn lock. Yes while the journal is intact. A journal whose
        records all check out but differ was written by another process (or put there by a person): it is the
        state now (False: read it). A damaged journal whose readable records are the ones `written` had is what
        this process wrote, damaged since: `whole()` (the copy, what was written) replaces it and nothing is lost.
        Damaged, and not ours: False, and the load that follows repairs it and says what was lost."""
        if self._intact(conversation_id, written):
            return True
        if written is None or conversation_id not in self._held:
            return False
        try:
            scan, stat = self._scan(conversation_id)
        except FileNotFoundError:
            return False
        if scan.problem is None:
            self._remember(conversation_id, scan, stat)
            return stat is not None and tuple(scan.digests) == written.digests  # the same records: only touched
        if not _ours(scan, written):
            return False
        self._rewrite(conversation_id, whole(), scan.problem)
        return True

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

    def written_length(self, conversation_id: str) -> int | None:
        """Tokens of the journal as this process last wrote or read it, if no other process has changed the file
        since (one stat); else None. The disaggregated relay sends a delta only on a journal it wrote itself."""
        journal = self._cached(conversation_id)
        return None if journal is None else journal.length

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
        """Delete records idle longer than the timeout (never one whose turn lock is held) and the lock files
        that dead processes left."""
        now, expired = time.time() if now is None else now, []
        for lock in self.root.glob("*.lock"):
            if _ID.match(lock.stem) and not lock.stem.startswith(".") and lock.stem not in self._held:
                descriptor = self._try_lock(lock.stem)  # taken: its holder died; released, the file goes
                if descriptor is not None:
                    self._unlock(lock.stem, descriptor)
        for conversation_id in self.conversations():
            path = self._record(conversation_id)
            try:
                idle = now - path.stat().st_mtime
            except FileNotFoundError:
                continue
            if idle <= self.idle_timeout_s or conversation_id in self._held:
                continue
            descriptor = self._try_lock(conversation_id)  # held for the delete: no turn starts on it meanwhile
            if descriptor is None:
                continue
            try:
                path.unlink(missing_ok=True)
                self._journals.pop(conversation_id, None)
                expired.append(conversation_id)
            finally:
                self._unlock(conversation_id, descriptor)
        return expired

    def usage(self) -> tuple[int, int]:
        """(conversations, bytes) the store holds: records plus conversations whose first turn is running (a lock
        without a record yet), and the bytes of every record."""
        ids, size = set(), 0
        with os.scandir(self.root) as entries:
            for entry in entries:
                stem, suffix = os.path.splitext(entry.name)
                if suffix == ".state":
                    ids.add(stem)
                    try:
                        size += entry.stat().st_size
                    except FileNotFoundError:
                        pass
                elif suffix == ".lock" and entry.name != OWNER:
                    ids.add(stem)
        return len(ids), size

    # -- the journal file -----------------------------------------------------------------------------------

    def _cached(self, conversation_id: str) -> _Journal | None:
        """This process's view of the journal, if the file is still the one it describes (one stat)."""
        journal = self._journals.get(conversation_id)
        try:
            stat = self._record(conversation_id).stat()
        except FileNotFoundError:
            self._journals.pop(conversation_id, None)
            return None
        return journal if journal is not None and journal.describes(stat) else None

    def _intact(self, conversation_id: str, journal: _Journal | None) -> bool:
        """Whether the file is exactly `journal`: one stat, and its last record read and checked again. The times
        catch a write anywhere in the file; the re-read catches one to the last record that lands in the same clock
        tick as ours (kernels without fine-grained file times), where a new turn would be appended. O(one record)."""
        if journal is None:
            return False
        try:
            with open(self._record(conversation_id), "rb") as file:
                if not journal.describes(os.fstat(file.fileno())):
                    return False
                file.seek(journal.tail)
                last = file.read(journal.size - journal.tail)
        except FileNotFoundError:
            return False
        try:
            return record_digest(last) == journal.digests[-1]
        except JournalError:
            return False

    def _writable(self, conversation_id: str) -> tuple[_Journal | None, str | None]:
        """The journal a writer appends to (None: none yet) and, when it was damaged since this process wrote it,
        what is wrong with it (the caller then writes its whole state instead: never a turn behind damage). A
        journal changed by another process is read again, a bad tail that is not ours repaired. Only the turn
        holding the lock writes, so the repair cannot cut off another writer's record."""
        known = self._journals.get(conversation_id)
        if self._intact(conversation_id, known):
            return known, None
        try:
            scan, _ = self._scan(conversation_id)
            if scan.problem is not None and _ours(scan, known):
                return None, scan.problem
            self._read(conversation_id, repair=True)
        except FileNotFoundError:
            return None, None
        return self._journals.get(conversation_id), None

    def _scan(self, conversation_id: str) -> tuple[JournalScan, os.stat_result | None]:
        """The journal read and checked, and the file's stat as read (None: it grew while it was read, so nothing
        may be cached or cut on the strength of this read)."""
        with open(self._record(conversation_id), "rb") as file:
            data = file.read()
            stat = os.fstat(file.fileno())
        return read_journal(data, self.config), stat if stat.st_size == len(data) else None

    def _remember(self, conversation_id: str, scan: JournalScan, stat: os.stat_result | None) -> None:
        """Cache what `scan` read, if the file (as `stat` finds it) holds exactly its good records."""
        self._journals.pop(conversation_id, None)
        if scan.deltas and stat is not None and stat.st_size == scan.good:
            self._journals[conversation_id] = _Journal(
                scan.good, stat.st_ino, (stat.st_mtime_ns, stat.st_ctime_ns), scan.deltas[-1].end_length,
                sum(d.added_nbytes() for d in scan.deltas), scan.deltas[-1].replaced_nbytes(), tuple(scan.digests),
                scan.tail)

    def _read(self, conversation_id: str, repair: bool) -> tuple[JournalScan, Path | None]:
        """The journal's good records and first problem, and where its bad part was moved (None: nothing moved).
        With `repair`, a bad tail is moved to quarantine and cut off; no good record: the file is moved there."""
        path = self._record(conversation_id)
        scan, stat = self._scan(conversation_id)
        moved = None
        if scan.problem is not None and repair and stat is not None:
            moved = self._quarantine(conversation_id, path, stat, scan)
            if moved is not None and scan.good:
                stat = path.stat()  # cut back to the good records
        self._remember(conversation_id, scan, stat)
        return scan, moved

    def _quarantine(self, conversation_id: str, path: Path, read: os.stat_result, scan: JournalScan) -> Path | None:
        """Move the bytes after the good records aside and cut the journal back to them; None if the file changed
        since it was read (someone else wrote it: nothing is cut)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        if (stat.st_size, stat.st_ino, stat.st_mtime_ns) != (read.st_size, read.st_ino, read.st_mtime_ns):
            return None
        target = self._quarantine_path(conversation_id, "tail")
        if scan.good == 0:
            os.replace(path, target)
            log.error("conversation %s: %s; no turn of its journal is readable, moved to %s", conversation_id,
                      scan.problem, target)
        else:
            with open(path, "rb") as file:
                file.seek(scan.good)
                _write_new(target, file.read())  # kept first: a crash between the two steps loses nothing
            os.truncate(path, scan.good)
            log.error("conversation %s: %s; back at its last good turn (%d bytes), the %d-byte tail moved to %s",
                      conversation_id, scan.problem, scan.good, read.st_size - scan.good, target)
        return target

    def _quarantine_path(self, conversation_id: str, kind: str) -> Path:
        folder = self.root / QUARANTINE
        folder.mkdir(exist_ok=True)
        return folder / f"{conversation_id}.{time.time_ns()}.{kind}"

    def _rewrite(self, conversation_id: str, snapshot: StateDelta, problem: str) -> None:
        """Replace a journal damaged since this process wrote it by `snapshot`, the whole state it holds; the
        damaged file is kept in quarantine/ (a hard link: no bytes copied, so it works on a full disk too)."""
        path, target = self._record(conversation_id), self._quarantine_path(conversation_id, "journal")
        try:
            os.link(path, target)
        except OSError:  # no hard links here (or the file is gone): a copy
            _write_new(target, path.read_bytes())
        try:
            self._write_snapshot(conversation_id, snapshot)
        except BaseException:
            target.unlink(missing_ok=True)  # the damaged journal is still in place; no copy of it stays behind
            raise
        log.error("conversation %s: %s; its journal was damaged since this server wrote it and has been rewritten "
                  "from the server's own copy (%d tokens, no turn lost), the damaged file moved to %s",
                  conversation_id, problem, snapshot.end_length, target)

    def _append(self, conversation_id: str, journal: _Journal, delta: StateDelta,
                state: ConversationState | None, snapshot: Callable[[], StateDelta] | None = None) -> None:
        record = encode_record(delta, self.config)
        added, replaced = journal.added + delta.added_nbytes(), delta.replaced_nbytes()
        # added + replaced: the bytes of the live state, what a snapshot of it holds; the rest is dead copies
        if journal.size + len(record) > 2 * (added + replaced) + self.compact_slack:
            if state is not None:
                self._write_snapshot(conversation_id, self.states.delta_of(state, 0))
            elif snapshot is not None:
                self._write_snapshot(conversation_id, snapshot())
            else:  # a delta from elsewhere: the journal's state plus it
                state = self.load(conversation_id)
                self.states.apply_delta(state, delta)
                self._write_snapshot(conversation_id, self.states.delta_of(state, 0))
            return
        # One write on an O_APPEND descriptor: it goes straight to the page cache, where every other process
        # reads it (no user-space buffer to flush; durability against a power cut is not asked for, so no fsync).
        path = self._record(conversation_id)
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            before = os.fstat(descriptor).st_size
            try:
                _write_all(descriptor, record)
            except OSError as error:  # a full disk: the part that was written is cut off again (we hold the lock)
                with contextlib.suppress(OSError):
                    os.ftruncate(descriptor, before)
                raise OSError(error.errno, error.strerror, str(path)) from None
            stat = os.fstat(descriptor)
        finally:
            os.close(descriptor)
        self._count(len(record))
        self._journals.pop(conversation_id, None)
        if stat.st_size == journal.size + len(record):  # else another process wrote meanwhile: read it next time
            self._journals[conversation_id] = _Journal(
                stat.st_size, stat.st_ino, (stat.st_mtime_ns, stat.st_ctime_ns), delta.end_length, added, replaced,
                journal.digests + (record[-DIGEST_SIZE:],), journal.size)

    def _write_snapshot(self, conversation_id: str, delta: StateDelta) -> None:
        path, record = self._record(conversation_id), encode_record(delta, self.config)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        written = _write_new(temporary, record)
        try:
            os.replace(temporary, path)  # readers see the old journal or the new one, never a mix
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        self._count(len(record))
        self._journals.pop(conversation_id, None)
        stat = path.stat()  # after the rename, which moves the change time
        if stat.st_ino == written.st_ino:  # else another process replaced it meanwhile: read it next time
            self._journals[conversation_id] = _Journal(
                stat.st_size, stat.st_ino, (stat.st_mtime_ns, stat.st_ctime_ns), delta.end_length,
                delta.added_nbytes(), delta.replaced_nbytes(), (record[-DIGEST_SIZE:],), 0)

    def _count(self, written: int) -> None:
        self.bytes_written += written
        self.last_write_bytes = written

    # -- one turn at a time ---------------------------------------------------------------------------------

    def _try_lock(self, conversation_id: str) -> int | None:
        """A descriptor holding the conversation's flock, or None when another holder has it (any process, or
        another descriptor of this one)."""
        path = self._lock(conversation_id)
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                return None
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(descriptor).st_ino:
                return descriptor
            # The holder before us removed the file as it released it: what we locked is no longer the lock.
            os.close(descriptor)

    def _unlock(self, conversation_id: str, descriptor: int) -> None:
        # Removed while still held, so that whoever opens the path next creates and locks a fresh file (_try_lock
        # checks that it locked the file the path names).
        self._lock(conversation_id).unlink(missing_ok=True)
        os.close(descriptor)

    def begin_turn(self, conversation_id: str) -> None:
        """Take the conversation's turn lock (held by this store until end_turn, or until the process dies). A
        conversation without a record is a new one: refused when the store is at its limits."""
        descriptor = None if conversation_id in self._held else self._try_lock(conversation_id)
        if descriptor is None:
            raise ConversationBusy(f"conversation {conversation_id!r} already has a turn in progress; "
                                   "send the next turn after this one's answer")
        try:
            if not self.exists(conversation_id):
                conversations, size = self.usage()
                self.limits.check_room(conversations - 1, size)  # less its own lock, just taken
            os.ftruncate(descriptor, 0)
            try:
                os.write(descriptor, f"{os.getpid()} {time.time():.0f}\n".encode())  # who holds it, for a person
            except OSError as error:  # a full disk: the turn could store nothing, refused before any work
                raise OSError(error.errno, error.strerror, str(self._lock(conversation_id))) from None
        except BaseException:
            self._unlock(conversation_id, descriptor)
            raise
        self._held[conversation_id] = descriptor

    def end_turn(self, conversation_id: str) -> None:
        """Release the lock if this store holds it (a turn it did not begin is left alone)."""
        descriptor = self._held.pop(conversation_id, None)
        if descriptor is not None:
            self._unlock(conversation_id, descriptor)


def _ours(scan: JournalScan, written: _Journal | None) -> bool:
    """Whether a damaged journal's readable records are the first of those `written` had: what this process
    wrote, damaged since (its copy of the state is then the whole truth)."""
    return written is not None and tuple(scan.digests) == written.digests[:len(scan.digests)]


def _write_all(descriptor: int, data: bytes) -> None:
    written = os.write(descriptor, data)
    while written < len(data):  # a short write (a signal, a full disk) continues where it stopped
        written += os.write(descriptor, memoryview(data)[written:])


def _write_new(path: Path, data: bytes) -> os.stat_result:
    """Create `path` holding `data`, and return its stat; on any failure (a full disk) nothing of it is left."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(descriptor, data)
        return os.fstat(descriptor)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(descriptor)


class StoreHold:
    """The store-level lock of a live server (python_backend/core/store.py hold_store); released by `release` or when
    the process dies."""

    def __init__(self, path: Path, descriptor: int):
        self.path, self.descriptor = path, descriptor

    def release(self) -> None:
        if self.descriptor is not None:
            os.close(self.descriptor)  # the file stays: unlinking it could let two servers lock two files
            self.descriptor = None


def hold_store(root: str | Path, owner: dict) -> StoreHold:
    """Hold the store for this server's life; `owner` (pid, host, ports) is written for whoever is refused. Raises
    StoreInUse naming the live server that holds it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / OWNER
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        try:
            holder = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            holder = {}
        described = ", ".join(f"{key} {value}" for key, value in holder.items()) or "details not written yet"
        raise StoreInUse(f"the conversation store {root} is held by another live server ({described}): stop it, "
                         "or give this server a store of its own (mol2 serve --store DIR)") from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(owner).encode(), 0)
    return StoreHold(path, descriptor)
