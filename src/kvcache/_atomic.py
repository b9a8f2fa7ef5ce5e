"""Files written whole or not at all: every path kvcache writes goes through :func:`atomic_write`.

The bytes go to a temporary file in the target's folder, which replaces the target (``os.replace``)
only once written and flushed to disk: a write that fails (a full disk, an exception while the
bytes are made) leaves whatever was at the path as it was, and no temporary file behind. A target
that is one of the command's inputs (the same path, a hard link, a symlink to it) is refused
before anything is written. A target that exists and is not a regular file (a device such as
/dev/null, a FIFO) is written in place: it cannot be replaced.
"""
from __future__ import annotations

import contextlib
import os
import stat
from typing import IO, Any, Iterator, Mapping, Union

__all__ = ["check_target", "atomic_write", "open_regular", "read_regular"]

_Path = Union[str, "os.PathLike[str]"]


def open_regular(path: _Path) -> IO[bytes]:
    """A file opened for reading, unbuffered; OSError unless it is a regular file (a FIFO or a
    device in its place would block the read, or never end)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) |
                 getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{os.fspath(path)}: is a directory, expected a file")
        if not stat.S_ISREG(mode):
            raise OSError(f"{os.fspath(path)}: not a regular file (a FIFO or a device is not read)")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: _Path) -> bytes:
    """The whole of a regular file (open_regular); OSError as one line naming the path."""
    try:
        with open_regular(path) as f:
            return f.read()
    except OSError as e:
        if not e.strerror:
            raise
        err = type(e)(f"{os.fspath(path)}: {e.strerror}")   # the same kind of error, in one line
        err.errno = e.errno
        raise err from None


def _same(a: _Path, b: _Path) -> bool:
    """The two paths name one file: the same inode where both exist, else the same resolved path."""
    try:
        return os.path.samestat(os.stat(a), os.stat(b))
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_target(path: _Path, *, sources: Mapping[str, _Path] | None = None, label: str | None = None) -> str:
    """Check that path can be written: its folder exists and is writable, it is not a folder and
    not one of sources (the files the command reads or also writes, each under the words that
    name it in an error, e.g. {"the input in.bin": "in.bin"}). Returns the path to replace (a
    symlink's target, so that the link stays). label names the path in errors (default: the
    path); each error is one line."""
    label = label or os.fspath(path)
    for what, src in (sources or {}).items():
        if _same(path, src):
            raise ValueError(f"{label}: is {what} (the same file): write to another path")
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise IsADirectoryError(f"{label}: is a directory, expected a file path")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{label}: no such directory: {os.path.dirname(os.path.abspath(path))}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(real) and not os.access(real, os.W_OK)):
        raise PermissionError(f"{label}: not writable")
    return real


def _temp(real: str) -> tuple[int, str]:
    """A new file beside real, opened for writing, with the mode a plain open() would give it."""
    folder, base = os.path.split(real)
    for _ in range(100):
        tmp = os.path.join(folder, f".{base}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{real}: no free temporary name in {folder}")


@contextlib.contextmanager
def atomic_write(path: _Path, mode: str = "wb", *, sources: Mapping[str, _Path] | None = None, label: str | None = None,
                 encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open path for writing through a temporary file that replaces it when the block ends
    without an exception (mode "wb" or "w"; encoding for "w"). On an exception the temporary
    file is removed and the path is left as it was; an OSError is raised again as one line
    naming the path (label, default the path). See :func:`check_target` for what is refused."""
    label = label or os.fspath(path)
    real = check_target(path, sources=sources, label=label)
    try:
        st: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # a device or a FIFO: written in place, there is nothing to keep
        try:
            with open(real, mode, encoding=encoding) as f:
                yield f
        except OSError as e:
            raise _reworded(e, f"{label}: not written: {e.strerror or e}") from None
        return
    try:
        fd, tmp = _temp(real)
    except OSError as e:
        raise _reworded(e, f"{label}: cannot create a file in {os.path.dirname(real)}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))   # replacing a file keeps its permissions
            yield f
            f.flush()
            os.fsync(f.fileno())     # a full disk may only tell here
        os.replace(tmp, real)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            kept = "; the file there is unchanged" if st is not None else ""
            raise _reworded(e, f"{label}: not written ({e.strerror or e}){kept}") from None
        raise


def _reworded(e: OSError, msg: str) -> OSError:
    """An OSError of e's class and errno whose text is msg alone."""
    new = type(e)(msg)
    new.errno = e.errno
    return new
