"""The blobs whose framings, reports and state reads tests/test_framing_compare.py holds against the
answers recorded in tests/data/framing_answers.json.gz: real states (the llama.cpp blobs of
tests/data, the golden traces' states, states kvcache writes from unified, iSWA, recurrent and
hybrid caches, with and without a sliding window, the per-cell extension or the sequence-blob
prefix), each also cut, extended, doubled, stripped of its prefix and with bytes flipped, all
from fixed seeds so that every run makes the same inputs.

    PYTHONPATH=src python tests/framing_inputs.py OUT.json.gz   # record the answers of a build

Each answer is JSON: the framings statefile finds with and without the prefix allowed (and the
reasons it gives for each plain framing that does not fit), what inspect reports (a digest of
the report, or its error), and for a state of a cache kvcache wrote, what state_read with the
layout found from the bytes does in a cache of the same geometry (the bytes consumed and a
digest of the cache's state after it, or the error)."""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
ANSWERS = DATA / "framing_answers.json.gz"
GOLDEN_PER_FILE = 2   # states taken from each golden trace
MUTANTS = 14          # mutated copies of each state (cuts, extensions, flipped bytes) besides the fixed ones

sys.path.insert(0, str(HERE / "fuzz"))
import make_corpus  # noqa: E402  (the fuzz seeds' readers of the golden traces and interop folders)

Maker = Callable[[], Any]


def _written(kvcache: Any, np: Any) -> Iterator[tuple[str, bytes, Maker | None, int]]:
    """States kvcache writes: (name, blob, a fresh cache of its geometry or None, seq_id)."""
    def unified(shape: tuple, ext: bool, seed: int) -> Maker:
        today, streams, swa, types, v_trans = shape
        return lambda: make_corpus.written_cache(kvcache, np, np.random.default_rng(seed), today=today,
                                                 streams=streams, swa=swa, types=types, v_trans=v_trans,
                                                 ext=ext)[0]

    for i, shape in enumerate(make_corpus.WRITTEN_SHAPES):
        make = unified(shape, False, i)
        c = make()
        layouts = ("2026", "2025") if shape[0] and not shape[1] else ("2026",) if shape[0] else ("2025",)
        for layout in layouts:
            for s in (-1, 0, 2):
                yield f"unified{i}-{layout}-s{s}", c.state_write(s, layout=layout), make, s
    for i, (streams, swa, types, v_trans, _) in enumerate(make_corpus.EXT_SHAPES[:3]):
        make = unified((True, streams, swa, types, v_trans), True, 100 + i)
        c = make()
        for layout in ("2026", "2026-03"):
            for s in (-1, 1):
                yield f"ext{i}-{layout}-s{s}", c.state_write(s, layout=layout), make, s

    def iswa(today: bool) -> Any:
        c = kvcache.ISWACache(64, n_layer=4, n_embd_k_gqa=8, n_embd_v_gqa=8, swa_layers=[1, 3], n_swa=6,
                              n_batch=16, n_seq_max=2, n_pad=1, type_k="f32", type_v="f32",
                              semantics="2026" if today else "2025")
        for s, n in ((0, 9), (1, 4)):
            assert c.find_slot(kvcache.UBatch(pos=list(range(n)), seq_id=[s] * n))
            if not today:
                c.commit()
        return c

    for today in (False, True):
        c = iswa(today)
        for s in (-1, 0):
            yield f"iswa-{today}-s{s}", c.state_write(s), (lambda t=today: iswa(t)), s

    def recurrent() -> Any:
        r = kvcache.RecurrentCache(n_seq_max=3, n_layer=2, n_embd_k_gqa=[6, 6], n_embd_v_gqa=4, n_embd_k_s=2,
                                   n_embd_v_s=[1, 3])
        assert r.find_slot(kvcache.UBatch([0, 1, 0, 1], [[0], [2]], n_seq_tokens=2))
        r.commit()
        return r

    r = recurrent()
    for s in (-1, 2):
        yield f"recurrent-s{s}", r.state_write(s), recurrent, s

    for falcon, n_seq_max, streams, window in ((0, 2, 0, 0), (1, 3, 1, 0), (0, 2, 0, 1), (1, 2, 1, 1)):
        n_layer, recr, attn = (2, [0], [0, 1]) if falcon else (3, [0, 2], [1])
        extra = dict(n_swa=5, swa_layers=attn[-1:], swa_full=False) if window else {}
        h = kvcache.HybridCache(32, n_layer, recr, 8, 8, 4, 2, n_seq_max=n_seq_max, attn_layers=attn,
                                kv_unified=not streams, **extra)
        rng = np.random.default_rng(n_seq_max)
        for s, n in ((0, 7), (n_seq_max - 1, 3)):
            for ub in h.ubatches(list(range(n)), [s] * n, 4):
                assert h.find_slot(ub)
                for il in attn:
                    h.store(il, rng.standard_normal((ub.n_tokens, 8)).astype(np.float16),
                            rng.standard_normal((ub.n_tokens, 8)).astype(np.float16))
                for il in recr:
                    h.store_state(il, rng.standard_normal((1, 4)).astype(np.float32),
                                  rng.standard_normal((1, 2)).astype(np.float32))
        name = f"hybrid{falcon}{n_seq_max}{streams}{window}"
        for s in (-1, 0):
            yield f"{name}-s{s}", h.state_write(s), None, s
        yield f"{name}-partial", h.state_write(0, partial_only=True), None, 0


def bases(kvcache: Any, np: Any) -> list[tuple[str, bytes, Maker | None, int]]:
    """The real states: (name, blob, a cache to read it into or None, seq_id)."""
    out: list[tuple[str, bytes, Maker | None, int]] = []
    for folder, today in (("interop", False), ("interop-v10", True), ("interop-hybrid", True)):
        for d in sorted((DATA / folder).iterdir()):
            if not d.is_dir() or d.name == "models":
                continue
            if folder != "interop-hybrid":   # (its sequence states are the files themselves)
                for k, (seq, blob) in enumerate(make_corpus.interop_blobs(d, today)):
                    out.append((f"{folder}/{d.name}/{k}", blob, None, seq))
            for f in sorted(d.iterdir()):
                if f.suffix in (".bin", ".ggsq", ".ggsn"):
                    out.append((f"{folder}/{d.name}/{f.name}", f.read_bytes(), None, -1))
    for kind in ("unified", "unified2026", "iswa", "recurrent"):
        for path in sorted((HERE / "golden" / kind).glob("*.jsonl"))[:12]:
            for k, (seq, blob) in enumerate(make_corpus.golden_blobs(path)):
                if k >= GOLDEN_PER_FILE:
                    break
                out.append((f"golden/{kind}/{path.stem}/{k}", blob, None, seq))
    out += list(_written(kvcache, np))
    return out


def mutants(name: str, blob: bytes) -> Iterator[tuple[str, bytes]]:
    """The blob and its mutations, the same on every run."""
    rng = random.Random(hashlib.sha256(name.encode()).digest())
    n = len(blob)
    yield "", blob
    yield "+0", blob + b"\0"
    yield "+4", blob + bytes(4)
    yield "x2", blob + blob
    yield "-8", blob[8:]
    for cut in sorted({0, 1, 4, 7, 8, 12, n // 2, n - 1, n - 4} - {n}):
        if 0 <= cut < n:
            yield f"cut{cut}", blob[:cut]
    for i in range(MUTANTS):
        b = bytearray(blob)
        op = i % 3
        if op == 0 and n:
            for _ in range(1 + i // 3):
                at = rng.randrange(n)
                b[at] ^= 1 << rng.randrange(8)
        elif op == 1 and n >= 4:
            at = rng.randrange(0, n - 3)
            struct.pack_into("<I", b, at, rng.choice((0, 1, 2, 3, 0xFFFFFFFF, rng.randrange(1 << 32))))
        else:
            b = b[:rng.randrange(n + 1)] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        yield f"m{i}", bytes(b)


def _digest(x: Any) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def answer(kvcache: Any, blob: bytes, make: Maker | None, seq_id: int) -> dict[str, Any]:
    """What the build says about blob (see the module's docstring)."""
    from kvcache import inspect, statefile

    out: dict[str, Any] = {}
    for ap in (True, False):
        framings, errors = statefile._framings(blob, ap)
        out[f"framings{int(ap)}"] = [[f.streams, f.prefixed, f.src_seq_id, f.parts, f.size, f.cell_ext,
                                      f.recurrent_records] for f in framings]
        out[f"errors{int(ap)}"] = {f"{int(k[0])}{k[1]}": _error(e) for k, e in sorted(errors.items())}
    try:
        out["inspect"] = _digest(inspect.report_bytes(blob))
    except (kvcache.StateError, ValueError) as e:
        out["inspect"] = _error(e)
    if make is not None:
        c = make()
        try:
            n = c.state_read(blob, seq_id)
            out["read"] = f"{n} {_digest(c.state_write().hex())}"
        except (kvcache.StateError, ValueError) as e:
            out["read"] = _error(e)
    return json.loads(json.dumps(out))   # tuples as lists, as the recorded file has them


def inputs(kvcache: Any, np: Any) -> Iterator[tuple[str, bytes, Maker | None, int]]:
    for name, blob, make, seq in bases(kvcache, np):
        for tag, b in mutants(name, blob):
            yield f"{name}{'/' + tag if tag else ''}", b, make, seq


def record(path: Path) -> int:
    import numpy as np

    import kvcache

    answers = {key: answer(kvcache, b, make, seq) for key, b, make, seq in inputs(kvcache, np)}
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(answers, f, sort_keys=True, separators=(",", ":"))
    print(f"{len(answers)} inputs recorded into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(record(Path(sys.argv[1]) if len(sys.argv) > 1 else ANSWERS))
