"""Files are never destroyed: every writer of kvcache that takes a path (the statefile writers,
`kvcache convert`, `kvcache simulate --plot`, `kvcache bench --json` and its --plot) refuses an
output that is its input (the same path, a hard link, a symlink), a missing folder or a folder,
in one line naming the path, and writes through a temporary file that replaces the output only
when complete: a write that fails midway (a full disk, a file-size limit, an error while the
bytes are made) leaves what was there and no temporary file behind."""
import contextlib
import errno
import importlib
import io
import os
import sys
import types

import pytest

import kvcache
from interop_data import interop_dir
from kvcache import cli, statefile

OLD = b"the output of an earlier run\n" * 8
SRC = interop_dir() / "llama_fa0" / "seq1.bin"     # a 0.3.10 sequence blob: convert's input


def _cache():
    c = kvcache.UnifiedCache(64, 2, 16, 16, n_seq_max=2)
    assert c.find_slot(kvcache.UBatch(list(range(40)), [0] * 40))
    c.commit()
    return c


def _fake_report():
    rows = [{"name": f"scale: seq_rm, {n} cells", "kvcache_ns": 100.0 * n, "extra": {"op": "seq_rm", "cells": n}}
            for n in (4096, 16384)]
    return {"rows": rows, "machine": {"time": "now", "load": 0.1}}


def _run(argv):
    """The CLI's exit status and stderr, raising OSError as the library would."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    return rc, err.getvalue()


def _bench_cli(path, monkeypatch):
    """`kvcache bench --json path` of a report made up here: the cases are not what is tested."""
    fake = types.ModuleType("kvcache_bench")
    fake.CASES = {"calls": None}
    fake.run = lambda *a, **k: _fake_report()
    fake.format_table = lambda report: "table"
    # the benchmark cases and their extension, where kvcache finds them
    for name in ("kvcache_bench", "kvcache_bench._bench", "kvcache._bench"):
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setitem(sys.modules, "kvcache.bench", fake)
    return ["bench", "--json", str(path)]


def _plot_report(path):
    pytest.importorskip("matplotlib")
    from kvcache.simulate import SimConfig, plot_report, simulate

    plot_report(simulate(SimConfig(steps=20, n_ctx=512)), str(path))


def _plot_scale(path):
    pytest.importorskip("matplotlib")
    for name in ("kvcache_bench.case_step", "kvcache._bench_step"):   # where `kvcache bench --plot` draws
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            break
    else:
        pytest.skip("the benchmark cases (kvcache_bench) are not importable")
    assert module.plot_scale(_fake_report(), str(path))


# Every writer: (name, suffix of its output, writes into path: a library call that raises, or the
# argv of a command whose exit status is 2 on an error)
LIBRARY = {
    "write_sequence_file": lambda p: statefile.write_sequence_file(p, _cache(), 0, list(range(40))),
    "write_session_file": lambda p: statefile.write_session_file(p, _cache(), "llama", list(range(40))),
    "write_context_state": lambda p: statefile.write_context_state(p, _cache(), "llama"),
    "simulate plot_report": _plot_report,
    "bench plot_scale": _plot_scale,
}
COMMANDS = {
    "kvcache convert": lambda p, mp: ["convert", str(SRC), str(p), "--to", "2026"],
    "kvcache simulate --plot": lambda p, mp: ["simulate", "--steps", "5", "--n-ctx", "512", "--plot", str(p)],
    "kvcache bench --json": _bench_cli,
}
SUFFIX = {"simulate plot_report": ".png", "bench plot_scale": ".png", "kvcache simulate --plot": ".png",
          "kvcache bench --json": ".json"}
WRITERS = sorted(LIBRARY) + sorted(COMMANDS)


def _write(name, path, monkeypatch):
    """Write with the named writer; returns None on success, else the one-line error."""
    if name in LIBRARY:
        try:
            LIBRARY[name](path)
        except (OSError, ValueError) as e:
            return str(e)
        return None
    if name == "kvcache simulate --plot":
        pytest.importorskip("matplotlib")
    rc, err = _run(COMMANDS[name](path, monkeypatch))
    if rc == 0:
        return None
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def _label(name):
    """What an error puts before the path: the option, for a command of several outputs."""
    return "--json " if name == "kvcache bench --json" else ""


def _target(tmp_path, name):
    return tmp_path / ("out" + SUFFIX.get(name, ".bin"))


def _left(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("name", WRITERS)
def test_writes_and_replaces(name, tmp_path, monkeypatch):
    out = _target(tmp_path, name)
    assert _write(name, out, monkeypatch) is None
    first = out.read_bytes()
    assert first and _left(tmp_path) == [out.name]
    out.write_bytes(OLD)
    out.chmod(0o640)
    assert _write(name, out, monkeypatch) is None
    assert out.read_bytes() != OLD and _left(tmp_path) == [out.name]
    assert out.stat().st_mode & 0o777 == 0o640      # a replaced file keeps its permissions


@pytest.mark.parametrize("name", WRITERS)
def test_a_missing_folder_is_one_line_naming_the_path(name, tmp_path, monkeypatch):
    out = tmp_path / "no" / "such" / _target(tmp_path, name).name
    err = _write(name, out, monkeypatch)
    assert err is not None and f"{out}: no such directory: {tmp_path / 'no' / 'such'}" in err
    assert _left(tmp_path) == []


@pytest.mark.parametrize("name", WRITERS)
def test_a_folder_as_output_is_refused(name, tmp_path, monkeypatch):
    folder = tmp_path / ("d" + _target(tmp_path, name).suffix)
    folder.mkdir()
    err = _write(name, folder, monkeypatch)
    assert err is not None and f"{folder}: is a directory, expected a file path" in err
    assert _left(tmp_path) == [folder.name] and _left(folder) == []


@pytest.mark.parametrize("name", WRITERS)
def test_a_symlink_is_written_through(name, tmp_path, monkeypatch):
    real = _target(tmp_path, name)
    real.write_bytes(OLD)
    link = tmp_path / ("link" + real.suffix)
    link.symlink_to(real.name)
    assert _write(name, link, monkeypatch) is None
    assert link.is_symlink() and real.read_bytes() != OLD
    assert _left(tmp_path) == sorted([real.name, link.name])


@contextlib.contextmanager
def _file_size_limit(n):
    """Writes past byte n of any file fail (EFBIG; Python ignores SIGXFSZ), as on a full disk."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("name", WRITERS)
def test_a_write_failing_midway_leaves_the_old_file(name, tmp_path, monkeypatch):
    out = _target(tmp_path, name)
    out.write_bytes(OLD)
    with _file_size_limit(100):
        err = _write(name, out, monkeypatch)
    assert err is not None and err.split(": error: ")[-1].startswith(f"{_label(name)}{out}: not written (")
    assert err.endswith("the file there is unchanged")
    assert out.read_bytes() == OLD and _left(tmp_path) == [out.name]


@pytest.mark.parametrize("name", WRITERS)
def test_a_full_disk_at_the_flush_leaves_the_old_file(name, tmp_path, monkeypatch):
    """Some file systems report ENOSPC only when the data goes to disk (fsync)."""
    out = _target(tmp_path, name)
    out.write_bytes(OLD)

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    err = _write(name, out, monkeypatch)
    assert err is not None and err.split(": error: ")[-1] == \
        f"{_label(name)}{out}: not written (No space left on device); the file there is unchanged"
    assert out.read_bytes() == OLD and _left(tmp_path) == [out.name]


def test_a_failure_while_the_bytes_are_made_leaves_the_old_file(tmp_path):
    class Failing:
        """A cache whose state fails after its first bytes."""

        def state_size(self, *a, **k):
            return 1000

        def state_write_into(self, f, *a, **k):
            f.write(b"\0" * 500)
            raise kvcache.StateError("the cache changed under the writer")

    out = tmp_path / "s.ggsq"
    out.write_bytes(OLD)
    with pytest.raises(kvcache.StateError, match="changed under"):
        statefile.write_sequence_file(out, Failing(), 0, [1, 2])
    assert out.read_bytes() == OLD and _left(tmp_path) == [out.name]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_device_is_one_line():
    """A device is written in place (it cannot be replaced): /dev/full fails every write."""
    with pytest.raises(OSError, match=r"^/dev/full: not written: No space left on device$"):
        statefile.write_sequence_file("/dev/full", _cache(), 0, list(range(40)))
    rc, err = _run(["convert", str(SRC), "/dev/full", "--to", "2026"])
    assert rc == 2 and err == "kvcache convert: error: /dev/full: not written: No space left on device\n"


def test_a_file_object_is_the_callers(tmp_path):
    """The writers write a file object at its position and leave it open."""
    buf = io.BytesIO(b"head")
    buf.seek(4)
    n = statefile.write_sequence_file(buf, _cache(), 0, list(range(40)))
    assert not buf.closed and buf.tell() == 4 + n and buf.getvalue()[:4] == b"head"


# --- an output that is the input -------------------------------------------------------------------

def _input_copy(tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(SRC.read_bytes())
    return src


@pytest.mark.parametrize("how", ["same path", "hard link", "symlink", "symlink to a symlink"])
def test_convert_refuses_an_output_that_is_its_input(how, tmp_path):
    src = _input_copy(tmp_path)
    out = src if how == "same path" else tmp_path / "out.bin"
    if how == "hard link":
        os.link(src, out)
    elif how == "symlink":
        out.symlink_to(src)
    elif how == "symlink to a symlink":
        (tmp_path / "mid.bin").symlink_to(src)
        out.symlink_to(tmp_path / "mid.bin")
    before = _left(tmp_path)
    rc, err = _run(["convert", str(src), str(out), "--to", "2026"])
    assert rc == 2
    assert err == f"kvcache convert: error: {out}: is the input {src} (the same file): write to another path\n"
    assert src.read_bytes() == SRC.read_bytes() and _left(tmp_path) == before


def test_convert_refuses_an_input_reached_by_another_path(tmp_path):
    src = _input_copy(tmp_path)
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / ".." / "in.bin"
    rc, err = _run(["convert", str(src), str(other), "--to", "2026"])
    assert rc == 2 and "is the input" in err and src.read_bytes() == SRC.read_bytes()


def test_bench_refuses_one_file_for_both_outputs(tmp_path):
    out = tmp_path / "b.json"
    rc, err = _run(["bench", "--json", str(out), "--plot", str(out)])   # before it runs anything
    assert rc == 2 and err == (f"kvcache bench: error: --plot {out}: is the file of --json {out} (the same "
                               "file): write to another path\n")
    assert not out.exists()
