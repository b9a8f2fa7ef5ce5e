"""Replay of golden trace files (recorded from llama.cpp): ``kvcache-trace/1`` and ``kvcache-trace/2026``.

Test tooling, not part of the kvcache package: it replays the traces of a clone (tests/golden),
and imports the reference models beside it (tests/reference.py, tests/reference2026.py). Under
pytest, tests/ is on ``sys.path``; from the command line, run it from tests/::

    cd tests && PYTHONPATH=../src python -m conformance golden/    # or one file / directory

A *family* is a kind of trace file: ``unified``, ``iswa``, ``recurrent``, ``split`` and ``rope``
(``kvcache-trace/1``) and ``unified2026`` (``kvcache-trace/2026`` files of kind ``unified``).
Each family has a module here (:data:`KINDS`, :data:`KINDS_2026`): its targets (:class:`Target`,
the implementations its traces replay against) and the ops it applies its own way.
Every op of every family is applied through one table, :data:`conformance.ops.OPS`;
:func:`conformance.ops.replay` replays a trace's ops, given as ``(index, op_dict)``
pairs (index = 1-based line number after the header), and raises :class:`Divergence` at the
first expected value that does not match, or for an op the family does not have (an
unsupported op is a failure, never a pass).

Every family is compared strictly, by the rules of :func:`conformance.common.compare_fields`
(the table of what each op may leave out or compare within a tolerance:
:data:`conformance.ops.FIELDS`): an expectation key the op does not produce fails, a field
the op produces that the trace lacks fails unless the table calls it optional, and a trace's
``atol`` never loosens a comparison beyond the family's cap.

``kvcache-trace/1`` files (the seed, mid-2025) replay against the caches of ``semantics="2025"``.
``kvcache-trace/2026`` files (today's llama.cpp) replay against a target of
:mod:`conformance.unified2026`: the C-backed cache of ``semantics="2026"``, or the
reference model :mod:`reference2026` (``--target`` chooses; the report names the target)."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field as _field
from typing import Any, Callable, Iterable, Mapping

FORMAT_1 = "kvcache-trace/1"
FORMAT_2026 = "kvcache-trace/2026"

KINDS = {
    "unified": "conformance.unified",
    "iswa": "conformance.iswa",
    "recurrent": "conformance.recurrent",
    "split": "conformance.split",
    "rope": "conformance.rope",
}

#: the kinds of kvcache-trace/2026 files and their replay modules
KINDS_2026 = {
    "unified": "conformance.unified2026",
}


class Divergence(Exception):
    """The first place a replay disagrees with a trace: op number ``index`` (its line in the
    file is ``index + 1``), named ``op``, at ``field``; ``reason`` says what is wrong when it is
    not a plain difference of values."""

    def __init__(self, index: int, op: str, field: str, expected: Any, got: Any, reason: str | None = None):
        self.index, self.op, self.field, self.expected, self.got = index, op, field, expected, got
        detail = reason if reason is not None else f"expected {_short(expected)}, got {_short(got)}"
        super().__init__(f"op #{index} ({op}): {field}: {detail}")


def _short(v: Any, limit: int = 300) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


@dataclass(frozen=True)
class Target:
    """An implementation the traces of one family replay against.

    ``name``: how reports call it; ``make_cache(config)``: a fresh cache for a trace header's
    config (None for the families whose traces need no cache: split, rope);
    ``make_ubatch(pos, seq_id)`` (with ``n_seq_tokens=`` when an op gives it): a ubatch in the
    form that cache takes; ``family``: the family it replays; ``data``: whether its caches hold
    K/V data (when not, the fill rule and the row moves of a defrag are left out); ``instead``:
    the ops it does not model, each replaced by a callable ``(cache, op)`` and compared on
    nothing."""

    name: str
    make_cache: Callable[[dict[str, Any]], Any]
    make_ubatch: Callable[..., Any]
    family: str = _field(kw_only=True)
    data: bool = _field(default=True, kw_only=True)
    instead: Mapping[str, Callable[[Any, dict[str, Any]], None]] = _field(default_factory=dict, kw_only=True)


@dataclass
class Replay:
    """One cache of a target under replay: ``cache``, made by ``target`` for ``config`` (a trace
    header's config), and ``strict``: whether the diagnostic ``info`` of the ops is compared
    too (the partial-window reports of an iSWA commit, the warnings of a recurrent find_slot,
    the bytes a successful state_read consumed)."""

    target: Target
    config: dict[str, Any]
    cache: Any
    strict: bool = False

    def ubatch(self, op: dict[str, Any]) -> Any:
        """The ubatch of an op (``pos``, ``seq_id`` and, when it has one, ``n_seq_tokens``) in
        the form the cache takes; with the token ids and 2-D positions it has (``tokens``,
        ``pos_x``, ``pos_y``: a cache with the per-cell extension stores them)."""
        extra = {k: op[k] for k in ("n_seq_tokens", "tokens", "pos_x", "pos_y") if k in op}
        return self.target.make_ubatch(op["pos"], op["seq_id"], **extra)


@dataclass
class FileResult:
    path: str
    kind: str
    n_ops: int
    divergence: Divergence | None
    #: the implementation the file ran against, for a kvcache-trace/2026 file and for a file run
    #: against a chosen target (None: a kvcache-trace/1 file against the C-backed cache)
    target: str | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def read_trace(path: str) -> tuple[dict, list[dict]]:
    """Header and op lines of a trace file (kvcache-trace/1 or kvcache-trace/2026)."""
    with open(path, "r", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("format") not in (FORMAT_1, FORMAT_2026):
        raise ValueError(f"{path}: not a {FORMAT_1} or {FORMAT_2026} file")
    return lines[0], lines[1:]


def run_file(path: str, target: Target | None = None) -> FileResult:
    """Replay one trace file against ``target`` when it is a :class:`Target` of the file's
    family, else against the family's default target: for kvcache-trace/1 files the C-backed
    caches, for kvcache-trace/2026 files the C-backed cache of the 2026 semantics. The result names the target of a kvcache-trace/2026 file,
    and of any file that ran against ``target``."""
    header, ops = read_trace(path)
    kind = header.get("kind", "?")
    is_2026 = header["format"] == FORMAT_2026
    kinds = KINDS_2026 if is_2026 else KINDS
    if kind not in kinds:
        return FileResult(path, kind, len(ops), Divergence(0, "header", "kind", list(kinds), kind))
    try:
        mod = importlib.import_module(kinds[kind])
        from conformance.ops import replay
    except ImportError as e:
        return FileResult(path, kind, len(ops), Divergence(0, "header", "kind", "supported", f"unsupported ({e})"))
    use = target if target is not None and target.family == mod.FAMILY else mod.default_target()
    name = use.name if is_2026 or use is target else None
    try:
        replay(use, header["config"], iter(enumerate(ops, start=1)))
    except Divergence as d:
        return FileResult(path, kind, len(ops), d, name)
    return FileResult(path, kind, len(ops), None, name)


def unsupported(index: int, op: dict) -> Divergence:
    """The Divergence for an op a replayer does not implement."""
    return Divergence(index, op.get("op", "?"), "op", "supported", "unsupported op")


#: the exception kinds a trace may expect, and what a replayer must see raised for each
EXCEPTION_KINDS = {"invalid_argument": (ValueError, IndexError, TypeError)}


def expected_exception(index: int, op: dict) -> tuple[type[BaseException], ...] | None:
    """The exceptions an op's ``{"exception": kind}`` expectation stands for, or None when the op
    expects fields. An expectation the runner does not know (another kind, a value that is not
    a known kind, or more keys beside it) is a Divergence: it must never pass by default."""
    expect = op.get("expect", {})
    if not isinstance(expect, dict):
        raise Divergence(index, op.get("op", "?"), "expect", "an object", expect)
    if "exception" not in expect:
        return None
    kind = expect["exception"]
    if len(expect) != 1 or not isinstance(kind, str) or kind not in EXCEPTION_KINDS:
        raise Divergence(index, op.get("op", "?"), "expect", f"{{'exception': one of {sorted(EXCEPTION_KINDS)}}}",
                         expect)
    return EXCEPTION_KINDS[kind]


def compare(index: int, op: dict, field: str, expected: Any, got: Any) -> None:
    """Raise Divergence unless expected == got."""
    if expected != got:
        raise Divergence(index, op.get("op", "?"), field, expected, got)


def main(argv: Iterable[str] | None = None) -> int:
    import argparse
    import glob
    import os

    ap = argparse.ArgumentParser(prog="python -m conformance",
                                 description="Replay kvcache golden traces and report divergences "
                                             "(run from tests/, beside the reference models).")
    ap.add_argument("paths", nargs="+", help="trace files or directories holding *.jsonl")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    ap.add_argument("--target", choices=["auto", "reference", "kvcache"], default="auto",
                    help="what kvcache-trace/2026 files replay against: the C-backed cache (auto, the default, "
                         "or kvcache) or the pure-Python reference model")
    args = ap.parse_args(list(argv) if argv is not None else None)
    from conformance.unified2026 import TARGETS
    target = TARGETS[args.target]()

    files: list[str] = []
    for p in args.paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "**", "*.jsonl"), recursive=True))
        else:
            files.append(p)
    n_pass = n_fail = 0
    for path in files:
        try:
            res = run_file(path, target)
        except (OSError, ValueError) as e:
            print(f"FAIL {path}: {e}")
            n_fail += 1
            continue
        against = f" ({res.target})" if res.target else ""
        if res.ok:
            n_pass += 1
            if not args.quiet:
                print(f"ok   {path} ({res.n_ops} ops){against}")
        else:
            n_fail += 1
            print(f"FAIL {path}{against}: {res.divergence}")
    print(f"{n_pass} passed, {n_fail} failed")
    return 0 if n_fail == 0 and n_pass > 0 else 1

