"""Reading byte ranges of checkpoint files straight into preallocated buffers, without the page cache.

A RAM budget is only honest if the OS does not quietly keep the model in its page cache. Files are opened
with O_DIRECT where the file system allows it: reads then need an aligned offset, length and address, so
each read covers the aligned span around the wanted bytes, in chunks of BOUNCE_BYTES through a per-thread
aligned bounce buffer, and copies out (a memory copy, far faster than the disk). Where O_DIRECT is refused
(tmpfs, some network file systems) reads go through the cache and the pages are dropped right after
(posix_fadvise DONTNEED); spans that touch (an expert's tensors) are one request there too, a `preadv` into their
buffers in turn.

Every read re-checks the file's size, modification time and inode change time (ctime) against what they were
when first opened: a checkpoint modified while running stops the run with a clear error instead of computing
with mixed weights. ctime catches in-place rewrites whose writer put the old mtime back (utime cannot set
ctime). The check is the one fstat a read already makes (about a microsecond against milliseconds of I/O), so
it costs nothing measurable; a per-expert checksum would cost a pass over every byte read.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moepager.config import DirectIO
from moepager.errors import CheckpointError
from moepager.types import Between

ALIGN = 4096
"""O_DIRECT alignment for offset, length and buffer address (covers 512-byte and 4K logical blocks)."""
BOUNCE_BYTES = 4 << 20
"""The most each reading thread's aligned bounce buffer takes: O_DIRECT runs are read through it in chunks,
so the read buffers are a small fixed amount (counted in the expert budget) whatever the expert size."""
WHOLE_SPAN_MIN = 64 * 1024
"""Experts of at least this many bytes are read in one request (`bounce_bytes`)."""


_SAID_NO_DIRECT: set[Path] = set()


def _say_no_direct(path: Path) -> None:
    """The fallback, said once per folder: where O_DIRECT is refused, reads go through the page cache."""
    if path.parent not in _SAID_NO_DIRECT:
        _SAID_NO_DIRECT.add(path.parent)
        print(f"note: the file system of {path.parent} refuses O_DIRECT reads; reading through the page cache instead "
              "(each read's pages dropped after it)", file=sys.stderr)


def bounce_bytes(read_nbytes: int) -> int:
    """Bounce buffer size for reads of about `read_nbytes`, at most BOUNCE_BYTES: their whole aligned span (whole
    pages, one more for an unaligned start), so an expert up to BOUNCE_BYTES is one request: a small expert's read
    is latency-bound, and four requests of each took several times one. Below WHOLE_SPAN_MIN (test-sized models) a
    quarter still: there five threads' whole-expert buffers would take most of the small budgets such
    models run in."""
    if read_nbytes < WHOLE_SPAN_MIN:
        return max(ALIGN, -(-read_nbytes // (4 * ALIGN)) * ALIGN)
    return min(BOUNCE_BYTES, -(-read_nbytes // ALIGN) * ALIGN + ALIGN)


MERGE_GAP = 64 * 1024
"""Spans this close in one file are read together with O_DIRECT (one request instead of several)."""


@dataclass(frozen=True)
class Span:
    """`nbytes` bytes at `offset` of `path`, to land in `out_u8` (a contiguous uint8 CPU tensor)."""

    path: Path
    offset: int
    out_u8: torch.Tensor


@dataclass
class _OpenFile:
    fd: int
    direct: bool
    size: int
    mtime_ns: int
    ctime_ns: int


class DiskFiles:
    """Open files (one descriptor each, shared by all threads; preadv is positional) and aligned bounce buffers.

    `direct`: "auto" uses O_DIRECT where supported, "on" requires it, "off" reads through the page cache and
    drops the pages afterwards.
    """

    def __init__(self, direct: DirectIO = "auto", bounce_nbytes: int = BOUNCE_BYTES):
        self.direct = direct
        self.bounce_nbytes = bounce_nbytes
        """Each reading thread's O_DIRECT bounce buffer (allocated on its first direct read)."""
        self._files: dict[Path, _OpenFile] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._finalizer = weakref.finalize(self, _close_all, self._files)

    def _open(self, path: Path) -> _OpenFile:
        f = self._files.get(path)
        if f is not None:
            return f
        with self._lock:
            if path in self._files:
                return self._files[path]
            fd, direct = self._open_fd(path)
            st = os.fstat(fd)
            f = self._files[path] = _OpenFile(fd, direct, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            return f

    def _open_fd(self, path: Path) -> tuple[int, bool]:
        try:
            if self.direct != "off" and hasattr(os, "O_DIRECT"):
                try:
                    return os.open(path, os.O_RDONLY | os.O_DIRECT), True
                except OSError:
                    if self.direct == "on":
                        raise CheckpointError(f"{path}: this file system refuses O_DIRECT reads; run with direct "
                                              f"I/O set to auto or off") from None
                    _say_no_direct(path)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: it would cache pages we never drop
            return fd, False
        except FileNotFoundError:
            raise CheckpointError(f"{path} disappeared while running; restart with the checkpoint in place") \
                from None

    def _check_unchanged(self, path: Path, f: _OpenFile) -> None:
        st = os.fstat(f.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (f.size, f.mtime_ns, f.ctime_ns):
            raise CheckpointError(f"{path} was modified while running (size {f.size} -> {st.st_size} bytes, or "
                                  f"its contents rewritten); weights read now would not match those already "
                                  f"loaded: restart the run")

    def _bounce(self) -> torch.Tensor:
        """This thread's aligned scratch buffer of `bounce_nbytes`."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            raw = torch.empty(self.bounce_nbytes + ALIGN, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % ALIGN
            buf = self._local.buf = raw[skip: skip + self.bounce_nbytes]
        return buf

    def read(self, spans: Sequence[Span], between: Between | None = None) -> int:
        """Fill every span's buffer from disk; returns the bytes read from the device (aligned spans included).
        With `between`, the read is requests of at most `bounce_nbytes` and `between` is called before each but
        the first (a prefetch gives way to demand loads there); without, each run is as few requests as it can be.

        With O_DIRECT, spans of one file lying within MERGE_GAP of each other are read as one aligned run.
        """
        gate = _after_first(between) if between is not None else None
        ordered = sorted(spans, key=lambda s: (str(s.path), s.offset))
        total, run = 0, [ordered[0]] if ordered else []
        for span in ordered[1:]:
            last = run[-1]
            if span.path == last.path and 0 <= span.offset - (last.offset + last.out_u8.numel()) <= MERGE_GAP:
                run.append(span)
            else:
                total += self._read_run(run, gate)
                run = [span]
        return total + (self._read_run(run, gate) if run else 0)

    def _read_run(self, run: Sequence[Span], gate: Between | None) -> int:
        """One run of spans; with `gate` (called before each request) in requests of at most `bounce_nbytes`."""
        path = run[0].path
        f = self._open(path)
        self._check_unchanged(path, f)
        first, last_end = run[0].offset, run[-1].offset + run[-1].out_u8.numel()
        if last_end > f.size:
            raise CheckpointError(f"{path}: needed bytes {first}..{last_end} lie past the end of the file "
                                  f"({f.size} bytes); the checkpoint is truncated")
        start, end = first - first % ALIGN, -(-last_end // ALIGN) * ALIGN
        if not f.direct:  # spans that touch (an expert's tensors, as safetensors lays them out) in one request
            groups: list[list[Span]] = []
            for span in run:
                if groups and span.offset == groups[-1][-1].offset + groups[-1][-1].out_u8.numel():
                    groups[-1].append(span)
                else:
                    groups.append([span])
            for g in groups:
                requests = _requests(g, self.bounce_nbytes) if gate else [([s.out_u8 for s in g], g[0].offset)]
                for outs, offset in requests:
                    if gate:
                        gate()
                    self._pread(path, f.fd, outs, offset, sum(out.numel() for out in outs))
            os.posix_fadvise(f.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            return last_end - first
        bounce, got = self._bounce(), 0
        for chunk in range(start, end, len(bounce)):  # aligned chunks; each span takes its overlap of each
            chunk_end = min(chunk + len(bounce), end)
            if gate:
                gate()
            got += self._pread(path, f.fd, [bounce[: chunk_end - chunk]], chunk, min(chunk_end, f.size) - chunk)
            for span in run:
                lo, hi = max(span.offset, chunk), min(span.offset + span.out_u8.numel(), chunk_end)
                if lo < hi:
                    span.out_u8[lo - span.offset: hi - span.offset].copy_(bounce[lo - chunk: hi - chunk])
        return got

    @staticmethod
    def _pread(path: Path, fd: int, outs: Sequence[torch.Tensor], offset: int, need: int) -> int:
        """Read at least `need` bytes at `offset` into the buffers `outs` in turn, one request (the last buffer may
        be longer, for aligned tails); a short read continues where it stopped."""
        views = [memoryview(out.numpy()).cast("B") for out in outs]
        done = 0
        try:
            while done < need:
                n = os.preadv(fd, views, offset + done)
                if n <= 0:
                    raise CheckpointError(f"{path}: short read at byte {offset + done}; was the file truncated?")
                done += n
                while views and n >= len(views[0]):  # drop the buffers filled, start inside the one that is not
                    n -= len(views.pop(0))
                if n:
                    views[0] = views[0][n:]
        except OSError as e:
            raise CheckpointError(f"{path}: read failed at byte {offset + done}: {e.strerror or e}") from e
        return done

    def close(self) -> None:
        with self._lock:
            _close_all(self._files)  # the finalizer stays armed for files opened after this


def _after_first(between: Between) -> Between:
    """`between` on every call but the first: a read calls it before each request, giving way after its first."""
    calls = 0

    def gate() -> None:
        nonlocal calls
        if calls:
            between()
        calls += 1
    return gate


def _requests(touching: Sequence[Span], most: int) -> Iterator[tuple[list[torch.Tensor], int]]:
    """Spans that follow each other in a file as requests of at most `most` bytes: (the buffers each fills in
    turn, its file offset)."""
    offset, outs, size = touching[0].offset, [], 0
    for span in touching:
        pos, n = 0, span.out_u8.numel()
        while pos < n:
            take = min(n - pos, most - size)
            outs.append(span.out_u8[pos: pos + take])
            size, pos = size + take, pos + take
            if size == most:
                yield outs, offset
                offset, outs, size = offset + size, [], 0
    if outs:
        yield outs, offset


def _close_all(files: dict[Path, _OpenFile]) -> None:
    """Close every descriptor (on `close()`, or when the DiskFiles is garbage-collected)."""
    for f in files.values():
        os.close(f.fd)
    files.clear()
