"""The check board of a gloo pool: a shared file where each rank writes a digest of every collective it
calls, so that ranks whose calls agree go on without a round trip through the parent (issue 44 item 4).

Every worker of a pool and the parent map one file (``board`` in the pool's directory). For each rank it
holds a wake word, a table of the groups the rank used in the current run, and per group a ring of entries,
one per sequence number: (group, run, sequence number, digest of the call). A digest covers everything the
referee compares for a collective: the group's name and members, the run, the sequence number, the call's
class and its key (:meth:`dstest.worlds.collectives.Call.key`). Equal digests mean matching calls.

What a rank reads of a call (:meth:`Board.status`) is one of:

- ``MATCH``: every member wrote an entry for it and the digests are equal: gloo can run it; the rank issues
  it itself, in sequence order per group, with no message to the parent;
- ``DIFFER``: two members' digests differ (a mismatch, a call whose ranks legitimately differ such as an
  all_to_all, or a rank that wrote a mark instead of a digest): the referee decides, as it always did, from
  every rank's full call;
- ``PENDING``: some member has not written its entry yet.

Once every member wrote, the answer is the same for everyone who asks, so the ranks agree on who decides each
call without talking. A rank that waits longer than a few milliseconds still posts its call to the referee,
which reads the board too: the referee answers "ok" for a call the board matches, and it is still what
reports a rank that finished without joining, a deadlock, and every mismatch, in the texts it always used.

Every read and write of the board is made under one lock: a ``flock`` on the file (which the kernel drops
when a holder dies) and a thread lock within a process, so no access sees another half done, on any CPU.
The wake words are futexes, two per rank (the word a thread waiting for a call sleeps on, the word its
watcher sleeps on) and a flag saying a thread waits: the write that decides a call (the last to arrive, or
one that differs) bumps each peer's word, the waiting thread's where one waits, and wakes it. Where futexes
are not available (not Linux, or ``DSTEST_CHECK_BOARD=0``) there is no board and every call goes to the
referee, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import mmap
import os
import platform
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["DIFFER", "MATCH", "PENDING", "Board", "available", "call_digest", "create", "mark"]

MATCH, DIFFER, PENDING = "match", "differ", "pending"

GROUPS = 64  # groups a rank can use in one run on the board (more: the others' calls go to the referee)
RING = 256  # entries per group: a rank may be this many calls ahead of a peer on one group
_HEADER = 64  # wake words and the waiting flag (u32 each), and padding
_SLOT = struct.Struct("<QII")  # table: group hash, run, highest sequence number this rank no longer needs
_ENTRY = struct.Struct("<QII16s")  # group hash, run, sequence number, digest
_TABLE = _HEADER
_ENTRIES = _TABLE + GROUPS * _SLOT.size
_RANK_BYTES = ((_ENTRIES + GROUPS * RING * _ENTRY.size + 4095) // 4096) * 4096

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the words are in a file mapped by processes
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc
    except OSError:
        return None


_LIBC = _libc()


def available() -> bool:
    """Whether this machine can hold a board (Linux with a known futex call): else every call is refereed."""
    return _LIBC is not None and os.environ.get("DSTEST_CHECK_BOARD", "1") != "0"


@functools.lru_cache(maxsize=4096)  # read on every look at the board: a few group keys a run
def gid_hash(gid: str) -> int:
    """A group's name as the board keys it (never 0: 0 is an unused slot)."""
    return int.from_bytes(hashlib.blake2b(gid.encode(), digest_size=8).digest(), "little") or 1


def call_digest(run: int, gid: str, members: Sequence[int], seq: int, call: Any) -> bytes:
    """The digest of one rank's call: equal for two ranks exactly when the referee would find their calls equal
    (its class and key, on the same group and members, at the same place of the same run)."""
    text = repr((run, gid, tuple(members), seq, type(call).__name__, call.key()))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def mark(run: int, rank: int, seq: int, why: str) -> bytes:
    """A digest no other rank's entry equals: what a rank writes for a call the referee must decide (``why``:
    the call needs every rank's call to be judged, or the rank gave the call up when its run ended)."""
    return hashlib.blake2b(repr(("mark", why, run, rank, seq)).encode(), digest_size=16).digest()


def create(path: str, world_size: int) -> None:
    """Make the board file of a pool of ``world_size`` ranks (sparse: untouched pages take no memory)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, world_size * _RANK_BYTES)
    finally:
        os.close(fd)


class Board:
    """One process's view of a pool's board (a worker's, or the parent's for its referee)."""

    def __init__(self, path: str, world_size: int) -> None:
        self.world_size = world_size
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, world_size * _RANK_BYTES)
        self.tlock = threading.Lock()
        # per rank: the waiting thread's wake word, the watcher's, and whether a thread waits
        self._words = [
            ctypes.c_uint32.from_buffer(self.mm, r * _RANK_BYTES + 4 * i) for r in range(world_size) for i in range(3)
        ]
        self._addrs = [ctypes.addressof(w) for w in self._words]
        self.slots: dict[tuple[int, int, int], int] = {}  # (rank, run, group hash) -> its slot, once found

    def close(self) -> None:
        self._words = []
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The board's lock, across the pool's processes and this process's threads."""
        with self.tlock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- the group table (under the lock) ----------------------------------------------------------------
    def _slot(self, rank: int, run: int, gh: int, claim: bool) -> int | None:
        """Where rank ``rank`` keeps group ``gh`` in run ``run``: found by probing from ``gh``'s home slot as the
        rank claimed it (``claim``: this is the rank itself, which takes the first slot unused in this run)."""
        key = (rank, run, gh)
        slot = self.slots.get(key)
        if slot is not None:
            return slot
        for i in range(GROUPS):
            k = (gh + i) % GROUPS
            h, r, _decided = _SLOT.unpack_from(self.mm, self._slot_at(rank, k))
            if r == run and h == gh:
                self.slots[key] = k
                return k
            if r != run:  # unused in this run: the group was never claimed by this rank
                if not claim:
                    return None
                _SLOT.pack_into(self.mm, self._slot_at(rank, k), gh, run, 0)
                self.slots[key] = k
                return k
        return None  # every slot taken in this run

    def _slot_at(self, rank: int, slot: int) -> int:
        return rank * _RANK_BYTES + _TABLE + slot * _SLOT.size

    def _entry_at(self, rank: int, slot: int, seq: int) -> int:
        return rank * _RANK_BYTES + _ENTRIES + (slot * RING + seq % RING) * _ENTRY.size

    def _decided(self, rank: int, slot: int) -> int:
        return int(_SLOT.unpack_from(self.mm, self._slot_at(rank, slot))[2])

    def set_decided(self, rank: int, run: int, gid: str, seq: int) -> None:
        """Rank ``rank`` no longer needs the board's entries of ``gid`` up to ``seq`` (under the lock)."""
        gh = gid_hash(gid)
        slot = self._slot(rank, run, gh, claim=False)
        if slot is not None and seq > self._decided(rank, slot):
            _SLOT.pack_into(self.mm, self._slot_at(rank, slot), gh, run, seq)

    # -- entries (under the lock) ------------------------------------------------------------------------
    def write(self, rank: int, run: int, gid: str, members: Sequence[int], seq: int, digest: bytes) -> bool:
        """Write rank ``rank``'s entry for call ``seq`` of ``gid``; False where it cannot (no group slot left, or
        a member still needs the entry ``RING`` calls back): then the rank writes nothing, and its peers, who
        find no entry, wait for the referee, who gets this call from the rank."""
        gh = gid_hash(gid)
        slot = self._slot(rank, run, gh, claim=True)
        if slot is None:
            return False
        if seq > RING:
            for m in members:
                other = self._slot(m, run, gh, claim=False)
                if other is None or self._decided(m, other) < seq - RING:
                    return False
        _ENTRY.pack_into(self.mm, self._entry_at(rank, slot, seq), gh, run, seq, digest)
        return True

    def overwrite(self, rank: int, run: int, gid: str, seq: int, digest: bytes) -> None:
        """Replace rank ``rank``'s digest of call ``seq`` of ``gid`` (with a :func:`mark`), if it wrote one."""
        gh = gid_hash(gid)
        slot = self._slot(rank, run, gh, claim=False)
        if slot is None:
            return
        at = self._entry_at(rank, slot, seq)
        h, r, s, _d = _ENTRY.unpack_from(self.mm, at)
        if (h, r, s) == (gh, run, seq):
            _ENTRY.pack_into(self.mm, at, gh, run, seq, digest)

    def status(self, run: int, gid: str, members: Sequence[int], seq: int) -> str:
        """``MATCH``, ``DIFFER`` or ``PENDING`` for call ``seq`` of ``gid`` (see the module's text)."""
        gh = gid_hash(gid)
        first: bytes | None = None
        pending = False
        for m in members:
            slot = self._slot(m, run, gh, claim=False)
            if slot is None:
                pending = True
                continue
            h, r, s, digest = _ENTRY.unpack_from(self.mm, self._entry_at(m, slot, seq))
            if (h, r, s) != (gh, run, seq):
                pending = True
                continue
            if first is None:
                first = digest
            elif digest != first:
                return DIFFER
        return PENDING if pending else MATCH

    # -- wake-ups -----------------------------------------------------------------------------------------
    # Two futex words per rank: one a thread waiting for a call sleeps on, one the watcher sleeps on (which
    # issues the calls nobody waits for), and a flag that says a thread waits: a write wakes one of them.
    def word(self, rank: int, watcher: bool = False) -> int:
        """Rank ``rank``'s wake word (read under the lock, before checking what to wait for)."""
        return int(self._words[3 * rank + watcher].value)

    def set_waiting(self, rank: int, waiting: bool) -> None:
        """Whether a thread of rank ``rank`` waits on the board (under the lock): its wake-ups go to it."""
        self._words[3 * rank + 2].value = int(waiting)

    def bump(self, ranks: Sequence[int]) -> list[int]:
        """Move the wake words of ``ranks`` on (under the lock): each one's waiting thread's, or its watcher's;
        returns what to :meth:`wake` once the lock is released."""
        woken = []
        for r in ranks:
            i = 3 * r + (0 if self._words[3 * r + 2].value else 1)
            w = self._words[i]
            w.value = (w.value + 1) & 0xFFFFFFFF
            woken.append(i)
        return woken

    def wake(self, woken: Sequence[int]) -> None:
        for i in woken:
            _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self._addrs[i]), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def sleep(self, rank: int, seen: int, seconds: float, watcher: bool = False) -> None:
        """Wait until rank ``rank``'s wake word (its watcher's) is no longer ``seen``, or ``seconds`` passed."""
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        addr = self._addrs[3 * rank + watcher]
        _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)
