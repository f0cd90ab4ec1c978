"""Disk reads: O_DIRECT and buffered give the file's bytes, leave no pages cached, and catch modified files."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

from moepager.checkpoints.disk import ALIGN, BOUNCE_BYTES, WHOLE_SPAN_MIN, DiskFiles, Span, bounce_bytes
from moepager.errors import CheckpointError


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (5 * ALIGN + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be dropped; written-back ones can
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path, data


def cached_pages(path) -> int:
    """Pages of `path` in the OS page cache (mincore over a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
            return sum(v & 1 for v in vec)
        finally:
            del addr
            mm.close()


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_spans_read_exact_bytes_and_leave_nothing_cached(data_file, direct):
    path, data = data_file
    files = DiskFiles(direct)
    spans = [(7, 100), (107, 5000), (3 * ALIGN + 1, 2 * ALIGN), (0, 3), (5 * ALIGN, 123)]
    outs = [torch.empty(n, dtype=torch.uint8) for _, n in spans]
    assert cached_pages(path) == 0
    nbytes = files.read([Span(path, off, out) for (off, _), out in zip(spans, outs)])
    for (off, n), out in zip(spans, outs):
        assert torch.equal(out, data[off: off + n])
    assert nbytes >= sum(n for _, n in spans)
    assert cached_pages(path) == 0
    files.close()


def test_modified_checkpoint_stops_the_run(data_file):
    path, _ = data_file
    files = DiskFiles()
    out = torch.empty(10, dtype=torch.uint8)
    files.read([Span(path, 0, out)])
    with open(path, "ab") as f:
        f.write(b"more")
    with pytest.raises(CheckpointError, match="modified while running"):
        files.read([Span(path, 0, out)])


def test_reading_past_the_end_is_reported(data_file):
    path, data = data_file
    with pytest.raises(CheckpointError, match="past the end"):
        DiskFiles().read([Span(path, data.numel() - 5, torch.empty(10, dtype=torch.uint8))])


def test_direct_reads_go_through_a_bounce_buffer_smaller_than_the_read(data_file):
    """O_DIRECT runs longer than the bounce buffer are read in aligned chunks; every byte still lands."""
    path, data = data_file
    files = DiskFiles("auto", bounce_nbytes=ALIGN)  # one page: every span below crosses chunk boundaries
    spans = [(5, 3 * ALIGN + 7), (4 * ALIGN - 9, ALIGN + 130)]
    outs = [torch.empty(n, dtype=torch.uint8) for _, n in spans]
    files.read([Span(path, off, out) for (off, _), out in zip(spans, outs)])
    for (off, n), out in zip(spans, outs):
        assert torch.equal(out, data[off:off + n])
    assert files._bounce().numel() == ALIGN


@pytest.mark.parametrize("offset", [0, 1, ALIGN - 1])
def test_an_expert_of_64_kib_or_more_is_one_request_at_any_offset(tmp_path, monkeypatch, offset):
    """The bounce buffer holds a whole expert's aligned span (latency-bound reads: one request, not four); smaller
    ones (test-sized models) keep a quarter, larger ones at most BOUNCE_BYTES."""
    nbytes = 98 * 1024 + 5  # the built-in model's expert size, plus an unaligned tail
    path = tmp_path / "expert.bin"
    data = torch.randint(0, 256, (offset + nbytes + 3 * ALIGN,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    path.write_bytes(data.numpy().tobytes())
    files = DiskFiles("auto", bounce_bytes(nbytes))
    requests = []
    real = os.preadv

    def counted(fd, buffers, at):  # noqa: ANN001, ANN202 - os.preadv's signature
        requests.append(at)
        return real(fd, buffers, at)
    monkeypatch.setattr(os, "preadv", counted)
    out = torch.empty(nbytes, dtype=torch.uint8)
    files.read([Span(path, offset, out)])
    assert torch.equal(out, data[offset:offset + nbytes])
    assert len(requests) == 1  # O_DIRECT where the file system takes it (here it does), else one buffered read
    assert bounce_bytes(WHOLE_SPAN_MIN - 1) < WHOLE_SPAN_MIN // 2 and bounce_bytes(1 << 30) == BOUNCE_BYTES
    files.close()


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_touching_spans_are_one_request_and_short_reads_resume_inside_a_buffer(data_file, monkeypatch, direct):
    """An expert's tensors lie end to end: buffered reads take them in one preadv of several buffers (O_DIRECT in one
    aligned run); a read that returns fewer bytes than asked (here at most 700 bytes a call, a page with O_DIRECT)
    continues in the buffer where it stopped, across buffer boundaries."""
    path, data = data_file
    spans = [(100, 3000), (3100, 5000), (8100, 2500), (12000, 7)]  # three touching, one apart
    real, calls = os.preadv, []
    limit = 700 if direct == "off" else ALIGN  # O_DIRECT takes whole pages only

    def short(fd, buffers, at):  # noqa: ANN001, ANN202 - os.preadv's signature
        calls.append(len(buffers))
        left, views = limit, []
        for buffer in buffers:  # the first `limit` bytes' worth of the buffers asked for
            if left:
                views.append(memoryview(buffer)[:left])
                left -= len(views[-1])
        return real(fd, views, at)
    monkeypatch.setattr(os, "preadv", short)
    files = DiskFiles(direct, bounce_nbytes=16 * ALIGN)
    outs = [torch.empty(n, dtype=torch.uint8) for _, n in spans]
    files.read([Span(path, off, out) for (off, _), out in zip(spans, outs)])
    for (off, n), out in zip(spans, outs):
        assert torch.equal(out, data[off:off + n])
    if direct == "off":
        assert calls[0] == 3  # the touching three in one request (resumed after each short read)
    files.close()


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_a_read_with_between_is_requests_of_at_most_the_bounce_size_with_between_before_each_but_the_first(
        data_file, monkeypatch, direct):
    """A prefetch's read gives way between chunks: touching spans (buffered: one request without `between`) are
    read in requests of at most `bounce_nbytes`, `between` runs before every request after the first, and every
    byte lands."""
    path, data = data_file
    spans = [(100, 3000), (3100, 5000), (8100, 2500), (12000 + ALIGN, 7)]  # three touching, one a page apart
    real, requests, events = os.preadv, [], []

    def logged(fd, buffers, at):  # noqa: ANN001, ANN202 - os.preadv's signature
        requests.append(sum(len(memoryview(b)) for b in buffers))
        events.append("read")
        return real(fd, buffers, at)
    monkeypatch.setattr(os, "preadv", logged)
    files = DiskFiles(direct, bounce_nbytes=ALIGN)
    outs = [torch.empty(n, dtype=torch.uint8) for _, n in spans]
    files.read([Span(path, off, out) for (off, _), out in zip(spans, outs)], between=lambda: events.append("between"))
    for (off, n), out in zip(spans, outs):
        assert torch.equal(out, data[off:off + n])
    assert max(requests) <= ALIGN and len(requests) >= 3
    assert events[0] == "read" and events[1:] == ["between", "read"] * (len(requests) - 1)
    events.clear()
    requests.clear()
    files.read([Span(path, off, out) for (off, _), out in zip(spans[:3], outs)])  # without: as few as it can be
    assert "between" not in events and len(requests) == (1 if direct == "off" else 3)
    files.close()


def test_a_file_system_refusing_o_direct_reads_through_the_page_cache_and_says_so_once(data_file, monkeypatch, capsys):
    """auto: where O_DIRECT is refused (tmpfs, some network file systems) the same bytes come through the page cache,
    its pages dropped, with one line saying so; on: a clear error instead."""
    import moepager.checkpoints.disk as disk

    path, data = data_file
    real_open = os.open

    def refusing(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *args)
    monkeypatch.setattr(disk.os, "open", refusing)
    monkeypatch.setattr(disk, "_SAID_NO_DIRECT", set())
    for _ in range(2):
        files = DiskFiles("auto")
        out = torch.empty(5000, dtype=torch.uint8)
        files.read([Span(path, 107, out)])
        files.close()
        assert torch.equal(out, data[107: 5107]) and cached_pages(path) == 0
    assert capsys.readouterr().err.count("refuses O_DIRECT reads; reading through the page cache") == 1
    with pytest.raises(CheckpointError, match="refuses O_DIRECT reads; run with direct I/O set to auto or off"):
        DiskFiles("on").read([Span(path, 0, torch.empty(10, dtype=torch.uint8))])
