"""One output discipline for every command: check output paths before any work, write under a temporary name
in the same directory and rename when complete, and never clobber a directory that holds something.

- `check_file(path, flag, replace)`: the directory must exist and take a new file (checked by creating and
  removing a probe file in it: permission bits say nothing to root, nor about read-only or special file systems
  such as /proc), the path must not be a directory, and an existing file is replaced only when `replace` says so;
  missing parent directories are refused, not created (a typo must not build a tree at /).
- `check_dir(path, flag, force)`: a directory output must not exist yet, or be empty, or `force` is given.
- `atomic_file(path)` / `atomic_dir(path, force)`: yield a temporary sibling to write into; on success it
  replaces `path` (with `force`, the old directory is removed only after the new one is complete), on any
  error or interrupt it is deleted, so nothing half-written is ever left under the final name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moepager.errors import ConfigError


class OutputError(ConfigError):
    """An output path cannot be written (missing directory, no permission, would clobber something)."""


def _writable_dir(directory: Path, flag: str, path: Path) -> None:
    """A probe file created and removed in `directory`: what the temporary output will need."""
    if not directory.is_dir():
        raise OutputError(f"{flag} {path}: directory {directory} does not exist; create it first")
    try:
        fd, probe = tempfile.mkstemp(prefix=".moepager-probe-", dir=directory)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write in {directory}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def check_file(path: str | os.PathLike[str] | None, flag: str, replace: bool = True) -> Path | None:
    """`path` can be written as a file (None passes: the output was not asked for); an existing file is refused
    unless `replace`."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if out.is_dir():
        raise OutputError(f"{flag} {out} is a directory; give a file name")
    if out.exists() and not replace:
        raise OutputError(f"{flag} {out} already exists; choose another name or pass --force to replace it")
    if out.exists() and not os.access(out, os.W_OK):
        raise OutputError(f"{flag} {out} exists and is not writable")
    _writable_dir(out.parent, flag, out)
    return out


def check_dir(path: str | os.PathLike[str], flag: str, force: bool) -> Path:
    """`path` can become an output directory: absent, empty, or replaced because `force` says so."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError(f"{flag} {out} already holds files; choose another directory or pass --force to "
                          f"replace it")
    _writable_dir(out.parent, flag, out)
    return out


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside `path`; renamed to `path` when the block completes, deleted if it fails."""
    out = Path(path)
    tmp = out.with_name(f".{out.stem}.partial-{os.getpid()}{out.suffix}")  # the suffix stays: it names the format
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """A temporary directory beside `path`; it becomes `path` when the block completes (an existing `path`
    is removed then, only with `force`), and is deleted if the block fails or is interrupted."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            if any(out.iterdir()) and not force:
                raise OutputError(f"{out} was filled by something else while writing; the new output is not moved "
                                  f"there (pass --force to replace it)")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
