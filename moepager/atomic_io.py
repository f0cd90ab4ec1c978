"""One output discipline for every command: check output paths before any work, write under a temporary name
in the same directory and rename when complete, and never clobber what the user owns without `--force`.

- `check_file(path, flag, replace, inputs)`: an existing regular file is replaced only when `replace` says so (every
  command's `--force`); the path must not be a directory or another kind of file, unless it is a character device
  or a pipe (`/dev/null`, `/dev/stdout`, `/dev/fd/N`), which is written in place and never replaced; it must not be
  one of the command's `inputs` nor lie inside an input directory (a checkpoint, a trace), `--force` or not; the
  directory must exist and take a new file (checked by creating and removing a probe file in it: permission bits say
  nothing to root, nor about read-only or special file systems such as /proc); missing parent directories are
  refused, not created (a typo must not build a tree at /).
- `check_dir(path, flag, force, inputs)`: a directory output must not exist yet, or be empty, or `force` is given;
  and it must not be an input, lie inside one, or hold one (`quantize --out` the folder above `--model`), `--force`
  or not.
- `atomic_file(path)` / `atomic_dir(path, force)`: yield a temporary sibling to write into; on success it
  replaces `path` (with `force`, the old directory is removed only after the new one is complete), on any
  error or interrupt it is deleted, so nothing half-written is ever left under the final name. A device or a pipe
  gets the finished bytes appended in place.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping
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


Inputs = Mapping[str, "str | os.PathLike[str] | None"]
"""A command's inputs by the option (or argument) that names each: `{"--model": path, "TRACE": trace}`."""


def writes_in_place(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is written in place: a character device or a pipe (or a name for one under /dev, such as
    /dev/stdout, whatever it points at), never replaced by a renamed file."""
    p = Path(path).expanduser()
    if str(p).startswith(("/dev/std", "/dev/fd/", "/proc/self/fd/")):
        return True
    try:
        mode = p.stat().st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def _not_an_input(out: Path, flag: str, inputs: Inputs, holds: bool = False) -> None:
    """Refuse an output that is one of the inputs or lies inside an input directory (and with `holds`, an output
    directory that holds an input)."""
    target = out.resolve()
    for name, given in inputs.items():
        if given is None:
            continue
        source = Path(given).expanduser().resolve()
        if target == source:
            raise OutputError(f"{flag} {out} is this command's input ({name}); write elsewhere")
        if source.is_dir() and target.is_relative_to(source):
            raise OutputError(f"{flag} {out} lies inside {source}, this command's input ({name}); write elsewhere")
        if holds and source.is_relative_to(target):
            raise OutputError(f"{flag} {out} holds {source}, this command's input ({name}), which writing it would "
                              "replace; write elsewhere")


def check_file(path: str | os.PathLike[str] | None, flag: str, replace: bool = False,
               inputs: Inputs | None = None) -> Path | None:
    """`path` can be written as a file (None passes: the output was not asked for); an existing file is refused
    unless `replace` (`--force`), an input always."""
    if path is None:
        return None
    out = Path(path).expanduser()
    if writes_in_place(out):
        if not os.access(out, os.W_OK):
            raise OutputError(f"{flag} {out} is not writable")
        return out
    if out.exists() and not out.is_file():
        if out.is_dir():
            raise OutputError(f"{flag} {out} is a directory; give a file name")
        raise OutputError(f"{flag} {out} is {_kind(out)}; give the name of a file to write")
    _not_an_input(out, flag, inputs or {})
    if out.exists() and not replace:
        raise OutputError(f"{flag} {out} already exists; choose another name or pass --force to replace it")
    if out.exists() and not os.access(out, os.W_OK):
        raise OutputError(f"{flag} {out} exists and is not writable")
    _writable_dir(out.parent, flag, out)
    return out


def check_dir(path: str | os.PathLike[str], flag: str, force: bool, inputs: Inputs | None = None) -> Path:
    """`path` can become an output directory: absent, empty, or replaced because `force` says so; never an input's
    folder, nor one inside or around an input."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out} exists and is not a directory")
    _not_an_input(out, flag, inputs or {}, holds=True)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputError(f"{flag} {out} already holds files; choose another directory or pass --force to "
                          f"replace it")
    _writable_dir(out.parent, flag, out)
    return out


@contextmanager
def _full_disk_named(out: Path) -> Iterator[None]:
    """An OSError while writing `out` on a file system that is now full is said as the full disk it is (errno
    ENOSPC, naming `out`), whatever the writer made of it (the gguf package: "2097152 requested and 1088256
    written")."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            full = shutil.disk_usage(out.parent).free < (1 << 20)
        except OSError:
            full = False
        if not full:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)) from e


SPACE_MARGIN = 64 << 20
"""Free space kept beyond what an output needs (a file system that fills up slows and fails for everyone)."""


def check_space(directory: Path, needed: int, what: str) -> None:
    """Refuse, before any work, an output of `needed` bytes that the file system of `directory` cannot take."""
    free = shutil.disk_usage(directory).free
    if needed + SPACE_MARGIN > free:
        raise OutputError(f"{what}: needs {needed / 1e9:.2f} GB, and {free / 1e9:.2f} GB are free on {directory}'s "
                          "file system; free space or write elsewhere")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clear_stale(out: Path) -> None:
    """Remove the temporary siblings of `out` that a run killed mid-write left (`.NAME.partial-PID`, `.NAME.old-PID`
    of a process no longer alive), saying so: a SIGKILLed split once left 1.6 GB behind that no run cleaned."""
    if not out.parent.is_dir():
        return
    for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*", f".{out.stem}.partial-*{out.suffix}"):
        for stale in out.parent.glob(pattern):
            pid = stale.name.rsplit("-", 1)[-1].split(".", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
            print(f"moepager: removed {stale}, left by a run that was stopped while writing {out}", file=sys.stderr)


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside `path`; renamed to `path` when the block completes, deleted if it fails. A device or
    a pipe (`writes_in_place`) gets the finished bytes appended instead (appended: `/dev/stdout` may be a file the
    shell opened, holding what the command printed before)."""
    out = Path(path)
    if writes_in_place(out):
        with tempfile.TemporaryDirectory(prefix="moepager-out-") as folder:
            tmp = Path(folder) / f"out{out.suffix}"
            yield tmp
            with open(tmp, "rb") as src, open(out, "ab") as dst:
                shutil.copyfileobj(src, dst)
        return
    clear_stale(out)
    tmp = out.with_name(f".{out.stem}.partial-{os.getpid()}{out.suffix}")  # the suffix stays: it names the format
    try:
        with _full_disk_named(out):
            yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """A temporary directory beside `path`; it becomes `path` when the block completes (an existing `path`
    is removed then, only with `force`), and is deleted if the block fails or is interrupted."""
    out = Path(path)
    clear_stale(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with _full_disk_named(out):
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
