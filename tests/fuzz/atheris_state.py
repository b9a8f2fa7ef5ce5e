"""atheris fuzz targets of kvcache's Python state decoders.

    python tests/fuzz/atheris_state.py TARGET [libFuzzer options] [corpus dirs...]

TARGET is one of:

- ``unified``: ``UnifiedCache.state_read`` (whole cache and per sequence, with convert / exact)
  and, for two parts, the iSWA reader over two caches; the input is laid out as for the
  libFuzzer target fuzz_unified_state (18-byte header choosing the caches, the destination, a
  prefill seed and the flags, then the blob), so tests/fuzz/corpus/fuzz_unified_state seeds it;
- ``unified2026``: ``UnifiedCache.state_read`` into a cache of semantics 2026 (one stream or one
  per sequence, with or without a window, with or without the per-cell extension, each layout or
  the one found from the bytes), input as for fuzz_state2026 (12-byte header, then the blob);
- ``recurrent``: ``RecurrentCache.state_read``, input as for fuzz_recurrent_state (20-byte
  header, then the blob);
- ``statefile``: ``kvcache.statefile.parse`` of a whole input (session file, sequence file,
  whole-context state or bare cache state, told apart by ``detect``); what it accepts must view
  the input exactly (tokens, outputs, logits, embeddings, the cache part at its offset), and the
  writers must reproduce the wrapper's bytes from the parsed fields;
- ``inspect``: ``kvcache inspect``'s report (``report_bytes`` with each variant choice) must
  raise StateError or give a report that formats as text and JSON and agrees with the input's
  size. Seeds for both: tests/fuzz/corpus/atheris_files (llama.cpp's files).

Each run checks the transactional contract through the public API: a StateError leaves
``cells()``, head / n / used (and has_shift) and every byte of ``k(il)`` / ``v(il)`` exactly as
they were; a successful read consumes at most the input, and the state it leaves, written with
``state_write`` and read back, writes the same bytes again. Any other exception, or a broken
contract, is a finding.

The check functions (test_unified, ...) also run without atheris: tests/test_fuzz_corpus.py
replays the seeds through them. For coverage of the C core the extension must be built with
clang and ``-fsanitize=fuzzer-no-link`` (plus address,undefined) and the sanitizer runtime with
libFuzzer preloaded: tools/fuzz-python.sh does both.
"""
from __future__ import annotations

import io
import json
import random
import struct
import sys
import warnings

try:
    import atheris
except ImportError:  # the checks alone, for replaying the seeds (tests/test_fuzz_corpus.py)
    atheris = None

if atheris is not None and __name__ == "__main__":
    # instrumented for coverage when fuzzing; the imports below then reuse these modules
    with atheris.instrument_imports(include=["kvcache"]):
        import kvcache.inspect
        import kvcache.statefile
import numpy as np

from kvcache import RecurrentCache, StateError, UBatch, UnifiedCache, inspect, statefile
from kvcache._core import _state_read_parts, _state_write_parts

TYPES = ["f32", "f16", "bf16", "q8_0"]
UNIFIED_SIZES = [32, 64, 96, 128, 256, 512, 1024, 4096]
MAX_KV_BYTES = 256 << 10


class ContractBroken(AssertionError):
    """The decoder broke its contract on this input."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ContractBroken(what)


def _row_bytes(t: str, n: int) -> int:
    return {"f32": 4 * n, "f16": 2 * n, "bf16": 2 * n, "q8_0": n // 32 * 34}[t]


# --- unified ---------------------------------------------------------------------------------

def _unified_geometry(data: bytes):
    """The caches, destination, prefill seed and read flags of an fuzz_unified_state input (its
    byte 4 also picks an allocation fault, which has no Python counterpart and is ignored)."""
    if len(data) < 18:
        return None
    b0, b1, b4 = data[0], data[1], data[4]
    tk, tv = TYPES[b0 & 3], TYPES[(b0 >> 2) & 3]
    v_trans = bool((b0 >> 4) & 1) and tv != "q8_0"
    n_seq_max = 1 + (b1 >> 3)
    seq_id = data[2] % (n_seq_max + 1) - 1

    def width(t, b):
        return 32 * (1 + b % 2) if t == "q8_0" else 1 + b % 64

    def part(kv_size, n_layer, widths):
        if n_layer == 0:
            return None  # the Python class needs a layer
        ek = [width(tk, widths[2 * l]) for l in range(n_layer)]
        ev = [width(tv, widths[2 * l + 1]) for l in range(n_layer)]
        if sum(_row_bytes(tk, ek[l]) + _row_bytes(tv, ev[l]) for l in range(n_layer)) * kv_size > MAX_KV_BYTES:
            return None
        return dict(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=ek, n_embd_v_gqa=ev, type_k=tk, type_v=tv,
                    v_trans=v_trans, n_seq_max=n_seq_max, n_pad=32)

    parts = [part(UNIFIED_SIZES[b1 & 7], (b0 >> 5) & 3, data[5:11])]
    if (b4 >> 6) & 1:
        parts.append(part(UNIFIED_SIZES[data[11] & 7], (data[11] >> 3) & 3, data[12:18]))
    if None in parts:
        return None
    flags = dict(convert=bool((b4 >> 4) & 1), exact=bool((b4 >> 5) & 1))
    return parts, seq_id, data[3], flags


def _fill_kv(cache: UnifiedCache, rng: random.Random) -> None:
    """Noise in every byte of the cache's K and V."""
    for il in cache.layers:
        for view in (cache.k(il), cache.v(il)):
            raw = view.view(np.uint8).reshape(-1)
            raw[:] = np.frombuffer(rng.randbytes(raw.size), dtype=np.uint8)


def _unified_prefill(cache: UnifiedCache, seed: int) -> None:
    rng = random.Random(seed)
    n_seq = cache.n_seq_max
    next_pos = [0] * n_seq
    max_ub = min(cache.size // 4, 64)
    n_ops = 1 + rng.randrange(24) if seed else 0

    def place(commit: bool) -> None:
        n = 1 + rng.randrange(max_ub)
        pos, ids = [], []
        for _ in range(n):
            s0 = rng.randrange(n_seq)
            lst = [s0]
            if n_seq > 1 and rng.randrange(4) == 0:
                s1 = rng.randrange(n_seq)
                if s1 != s0:
                    lst.append(s1)
            ids.append(lst)
            pos.append(next_pos[s0])
            next_pos[s0] += 1
        if cache.find_slot(UBatch(pos, ids)) and commit:
            cache.commit()

    for _ in range(n_ops):
        s = rng.randrange(n_seq)
        op = rng.randrange(10)
        if op < 5:
            place(True)
        elif op == 5:
            p0 = rng.randrange(64) - 8
            cache.seq_rm(-1 if rng.randrange(4) == 0 else s, p0, p0 + rng.randrange(48))
        elif op == 6:
            cache.seq_cp(s, rng.randrange(n_seq))
        elif op == 7:
            cache.seq_add(s, 0, -1, rng.randrange(9) - 4)
        elif op == 8:
            if cache.defrag_prepare(1 + rng.randrange(64)):
                cache.defrag_move()
        else:
            cache.seq_div(s, 0, -1, 2)
    if seed & 0x80:
        place(False)  # leaves recovery information behind
    _fill_kv(cache, rng)


def _unified_image(cache: UnifiedCache):
    return (cache.cells(), cache.head, cache.n, cache.used, cache.has_shift,
            [(bytes(cache.k(il).view(np.uint8)), bytes(cache.v(il).view(np.uint8))) for il in cache.layers])


def _same_unified(a, b) -> bool:
    (ca, *ra, kva), (cb, *rb, kvb) = a, b
    return ca == cb and ra == rb and kva == kvb


def test_unified(data: bytes) -> None:
    parsed = _unified_geometry(data)
    if parsed is None:
        return
    parts, seq_id, seed, flags = parsed
    caches = []
    for k, geometry in enumerate(parts):
        cache = UnifiedCache(**geometry)
        _unified_prefill(cache, (seed + 37 * k) % 256 if seed else 0)
        caches.append(cache)
    blob = data[18:]
    before = [_unified_image(c) for c in caches]
    try:
        consumed = _state_read_parts(tuple(caches), blob, seq_id, layout="2025", **flags)
    except StateError:
        _require(all(_same_unified(b, _unified_image(c)) for b, c in zip(before, caches)),
                 "a failed state_read changed a cache")
        return
    _require(0 < consumed <= len(blob), f"consumed {consumed} of {len(blob)} bytes")
    _require(not flags["exact"] or consumed == len(blob), "an exact read left trailing bytes")
    for layout in ("2025", "2026"):
        # written in each layout, read back in it
        w1 = _state_write_parts(tuple(caches), seq_id, layout)
        _require(_state_read_parts(tuple(caches), w1, seq_id, exact=True, layout=layout) == len(w1),
                 f"the re-write in layout {layout} was not consumed whole")
        _require(_state_write_parts(tuple(caches), seq_id, layout) == w1,
                 f"reading the re-write in layout {layout} back changed the state")


# --- unified, semantics 2026 ------------------------------------------------------------------

CACHE_SIZES = [32, 64, 96, 128, 256, 512, 1024, 2048]
FC_PLE_TOKEN = 262144  # tests/fuzz/fuzz_cache.h
# the layout given for a cache with the per-cell extension: (stream counts, bytes of it) -> name
EXT_LAYOUT_NAMES = {(True, 0): "2025-08", (True, 8): "2026-05", (True, 12): "2026", (False, 0): "2025",
                    (False, 8): "2025", (False, 12): "2025"}


def _unified2026_geometry(data: bytes):
    """The cache, destination, prefill seed, read flags and layout of a fuzz_state2026 input (the
    geometry bytes of tests/fuzz/fuzz_cache.h; the allocation fault is ignored). A cache with the
    per-cell extension is given the named layout nearest to the header's (no name has the
    extension without stream counts)."""
    if len(data) < 12:
        return None
    b0, b1, b2, b4 = data[0], data[1], data[2], data[4]
    tk, tv = TYPES[b0 & 3], TYPES[(b0 >> 2) & 3]
    n_layer = min(1 + ((b0 >> 5) & 3), 3)
    n_seq_max = 1 + ((b1 >> 3) & 3)
    streams = bool((b1 >> 6) & 1)

    def width(t, b):
        return 32 * (1 + b % 2) if t == "q8_0" else 1 + b % 64

    ek = [width(tk, data[5 + 2 * l]) for l in range(n_layer)]
    ev = [width(tv, data[6 + 2 * l]) for l in range(n_layer)]
    kv_size = CACHE_SIZES[b1 & 7]
    rows = kv_size * (n_seq_max if streams else 1)
    if sum(_row_bytes(tk, ek[l]) + _row_bytes(tv, ev[l]) for l in range(n_layer)) * rows > 2 * MAX_KV_BYTES:
        return None
    swa = dict(n_swa=1 + (b2 & 31), swa_type="chunked" if (b2 >> 5) & 1 else "standard") if b1 >> 7 else {}
    ext = dict(cell_ext=True, ple_token=FC_PLE_TOKEN if b2 >> 7 else None) if (b2 >> 6) & 1 else {}
    geometry = dict(kv_size=kv_size, n_layer=n_layer, n_embd_k_gqa=ek, n_embd_v_gqa=ev, type_k=tk, type_v=tv,
                    v_trans=bool((b0 >> 4) & 1) and tv != "q8_0", n_seq_max=n_seq_max, n_pad=32,
                    semantics="2026", kv_unified=not streams, **swa, **ext)
    layout = None if (b4 >> 6) & 1 else "2026" if b4 >> 7 else "2025"
    if ext and layout is not None:
        ext_bytes = (12 if (data[11] >> 4) & 1 else 8) if (data[11] >> 3) & 1 else 0
        layout = EXT_LAYOUT_NAMES[(layout == "2026", ext_bytes)]
    flags = dict(convert=bool((b4 >> 4) & 1), exact=bool((b4 >> 5) & 1), layout=layout)
    return geometry, (data[11] & 7) % (n_seq_max + 1) - 1, data[3], flags


def _unified2026_prefill(cache: UnifiedCache, seed: int) -> None:
    """A mix of operations; the placements into a cache with the per-cell extension carry 2-D
    positions, token ids, both or neither."""
    rng = random.Random(seed)
    ext = cache.stream_cells()[0].ext is not None
    n_seq = cache.n_seq_max
    next_pos = [0] * n_seq
    max_ub = min(cache.size // 4, 64)
    for _ in range(1 + rng.randrange(24) if seed else 0):
        s = rng.randrange(n_seq)
        op = rng.randrange(9)
        if op < 5:
            n = 1 + rng.randrange(max_ub)
            kind = rng.randrange(4) if ext else 0
            more = {}
            if kind & 1:
                more.update(pos_x=[rng.randrange(64) for _ in range(n)], pos_y=[rng.randrange(64) for _ in range(n)])
            if kind & 2:
                more.update(tokens=[rng.randrange(1 << 20) - 1 for _ in range(n)])
            cache.find_slot(UBatch(list(range(next_pos[s], next_pos[s] + n)), [s] * n, **more))
            next_pos[s] += n
        elif op == 5:
            p0 = rng.randrange(64) - 8
            cache.seq_rm(-1 if rng.randrange(4) == 0 else s, p0, p0 + rng.randrange(48))
        elif op == 6:
            cache.seq_cp(s, rng.randrange(n_seq))  # across streams: a queued stream copy
            if rng.randrange(2):
                cache.update()
        elif op == 7:
            cache.seq_add(s, 0, -1, rng.randrange(9) - 4)
        else:
            cache.seq_div(s, 0, -1, 2)
    _fill_kv(cache, rng)


def _unified2026_image(cache: UnifiedCache):
    return (cache.stream_cells(), cache.heads, cache.n, cache.used_per_stream, cache.has_shift,
            cache.pending_copies,
            [(bytes(cache.k(il).view(np.uint8)), bytes(cache.v(il).view(np.uint8))) for il in cache.layers])


def test_unified2026(data: bytes) -> None:
    parsed = _unified2026_geometry(data)
    if parsed is None:
        return
    geometry, seq_id, seed, flags = parsed
    cache = UnifiedCache(**geometry)
    _unified2026_prefill(cache, seed)
    blob = data[12:]
    before = _unified2026_image(cache)
    try:
        consumed = cache.state_read(blob, seq_id, **flags)
    except StateError:
        _require(before == _unified2026_image(cache), "a failed state_read changed the cache")
        return
    _require(0 < consumed <= len(blob), f"consumed {consumed} of {len(blob)} bytes")
    _require(not flags["exact"] or consumed == len(blob), "an exact read left trailing bytes")
    if geometry.get("cell_ext"):
        layouts = ("2026", "2026-03")  # the cells' extensions whole, then without token ids
    else:
        layouts = ("2026",) if cache.n_stream > 1 else ("2025", "2026")
    for layout in layouts:
        w1 = cache.state_write(seq_id, layout=layout)
        # into an empty twin the cells go in order: the state written again is the same
        twin = UnifiedCache(**geometry)
        _require(twin.state_read(w1, seq_id, exact=True, layout=layout) == len(w1),
                 f"the re-write in layout {layout} was not consumed whole by an empty cache")
        _require(twin.state_write(seq_id, layout=layout) == w1,
                 f"the re-write in layout {layout}, read into an empty cache, wrote other bytes")
        try:
            n = cache.state_read(w1, seq_id, exact=True, layout=layout)
        except StateError as e:
            # a sequence's cells that other sequences share stay taken: its state may not fit
            _require(seq_id >= 0 and "no room" in str(e), f"the re-write in layout {layout} refused: {e}")
            continue
        _require(n == len(w1), f"the re-write in layout {layout} was not consumed whole")
        # (a sequence's cells may come back rotated: today's find_slot wraps around the head)
        _require(seq_id >= 0 or cache.state_write(seq_id, layout=layout) == w1,
                 f"reading the re-write in layout {layout} back changed the state")


# --- recurrent -------------------------------------------------------------------------------

def _recurrent_geometry(data: bytes):
    if len(data) < 20:
        return None
    b0, b1 = data[0], data[1]
    tk, tv = TYPES[b0 & 3], TYPES[(b0 >> 2) & 3]
    n_layer = 1 + ((b0 >> 4) & 3)
    kv_size = 1 + (b1 & 15)
    n_seq_max = min(b1 >> 4, kv_size)
    seq_id = data[2] % (n_seq_max + 1) - 1

    def width(t, w):
        return 32 * (w & 0x7F) if t == "q8_0" else w & 0xFFF

    ws = struct.unpack_from("<8H", data, 4)
    ek = [width(tk, ws[2 * l]) for l in range(n_layer)]
    ev = [width(tv, ws[2 * l + 1]) for l in range(n_layer)]
    total = sum(_row_bytes(tk, ek[l]) + _row_bytes(tv, ev[l]) for l in range(n_layer)) * kv_size
    if total > (2 << 20):
        return None
    return dict(n_seq_max=n_seq_max, n_layer=n_layer, n_embd_k_gqa=ek, n_embd_v_gqa=ev, type_k=tk, type_v=tv,
                kv_size=kv_size), seq_id, data[3]


def _recurrent_prefill(cache: RecurrentCache, seed: int) -> None:
    rng = random.Random(seed)
    n_seq = cache.n_seq_max
    next_pos = [0] * max(n_seq, 1)
    n_ops = 1 + rng.randrange(16) if seed else 0
    for _ in range(n_ops):
        s = rng.randrange(max(n_seq, 1))
        op = rng.randrange(12)
        if n_seq == 0:
            op = 12  # nothing but clear-like no-ops without sequences
        if op < 5:
            order = rng.sample(range(n_seq), n_seq)[: 1 + rng.randrange(n_seq)]
            n_seq_tokens = 1 + rng.randrange(4)
            groups, k = [], 0
            while k < len(order):
                take = 2 if rng.randrange(4) == 0 and k + 1 < len(order) else 1
                groups.append(order[k:k + take])
                k += take
            pos = []
            for g in groups:
                pos += range(next_pos[g[0]], next_pos[g[0]] + n_seq_tokens)
                next_pos[g[0]] += n_seq_tokens
            try:
                with warnings.catch_warnings():
                    # positions that do not continue a state are expected here
                    warnings.simplefilter("ignore", RuntimeWarning)
                    cache.find_slot(UBatch(pos, groups, n_seq_tokens=n_seq_tokens))
            except (MemoryError, ValueError, RuntimeError):
                pass  # no room, or the reference's own inconsistency after seq_rm(-1)
        elif op == 5:
            cache.seq_rm(s, -1, -1)
        elif op == 6:
            cache.seq_rm(-1, -1, -1)
        elif op == 7:
            cache.seq_cp(s, rng.randrange(n_seq))
        elif op == 8:
            cache.seq_add(s, -1, -1, rng.randrange(9) - 4)
        elif op == 9:
            (cache.s_copy if rng.randrange(2) else cache.s_mask)()
        elif op == 10:
            cache.seq_keep(s)
        elif op == 11:
            cache.seq_div(s, -1, -1, 2)
    for il in range(cache.n_layer):
        for view in (cache.k(il), cache.v(il)):
            raw = view.view(np.uint8).reshape(-1)
            raw[:] = np.frombuffer(rng.randbytes(raw.size), dtype=np.uint8)


def _recurrent_image(cache: RecurrentCache):
    cells = cache.cells()
    return ([cells["pos"].tobytes(), cells["src"].tobytes(), cells["tail"].tobytes(), cells["seq_id"]],
            cache.head, cache.n, cache.used,
            [(bytes(cache.k(il).view(np.uint8)), bytes(cache.v(il).view(np.uint8))) for il in range(cache.n_layer)])


def test_recurrent(data: bytes) -> None:
    parsed = _recurrent_geometry(data)
    if parsed is None:
        return
    geometry, seq_id, seed = parsed
    cache = RecurrentCache(**geometry)
    _recurrent_prefill(cache, seed)
    blob = data[20:]
    before = _recurrent_image(cache)
    try:
        consumed = cache.state_read(blob, seq_id, layout="2025")
    except StateError:
        _require(before == _recurrent_image(cache), "a failed state_read changed the cache")
        return
    _require(0 < consumed <= len(blob), f"consumed {consumed} of {len(blob)} bytes")
    for layout in ("2025", "2026"):
        w1 = cache.state_write(seq_id, layout=layout)
        _require(cache.state_read(w1, seq_id) == len(w1), f"the re-write in layout {layout} was not consumed whole")
        # (a recurrent state is the same in every layout: the prefix alone tells them apart)
        _require(cache.state_write(seq_id, layout=layout) == w1,
                 f"reading the re-write in layout {layout} back changed the state")


# --- state files and kvcache inspect -----------------------------------------------------------

_EMPTY = None


def _empty_cache() -> UnifiedCache:
    """A small empty cache: what the writers put after the wrapper's header does not matter here."""
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = UnifiedCache(32, 1, 2, 2, type_k="f32", type_v="f32", n_seq_max=1)
    return _EMPTY


def _context_fields_ok(ctx, data: bytes, start: int) -> None:
    """ctx (parsed from data[start:]; its cache_offset counts from the start of data) views data
    exactly, and the writer reproduces its header."""
    _require(start <= ctx.cache_offset <= len(data), "the cache part starts outside the input")
    _require(bytes(ctx.cache) == data[ctx.cache_offset:], "the cache part is not the rest of the input")
    out = io.BytesIO()
    statefile.write_context_state(out, _empty_cache(), ctx.arch, output_pos=ctx.output_pos, logits=ctx.logits,
                                  embeddings=ctx.embeddings, layout=ctx.layout)
    _require(out.getvalue()[:ctx.cache_offset - start] == data[start:ctx.cache_offset],
             "write_context_state does not reproduce the parsed header")


def test_statefile(data: bytes) -> None:
    try:
        obj = statefile.parse(data)
    except StateError:
        return
    kind = statefile.detect(data)
    if kind == "cache":
        _require(isinstance(obj, memoryview) and bytes(obj) == data, "a bare cache state is not the input")
    elif kind == "context":
        _require(isinstance(obj, statefile.ContextState), f"{type(obj).__name__} for a context state")
        _context_fields_ok(obj, data, 0)
    elif kind == "session":
        _require(isinstance(obj, statefile.SessionFile), f"{type(obj).__name__} for a session file")
        n = len(obj.tokens)
        _require(obj.tokens.tobytes() == data[12:12 + 4 * n], "the tokens are not the input's")
        _context_fields_ok(obj.context, data, 12 + 4 * n)
        out = io.BytesIO()
        statefile.write_session_file(out, _empty_cache(), obj.context.arch, obj.tokens,
                                     output_pos=obj.context.output_pos, logits=obj.context.logits,
                                     embeddings=obj.context.embeddings, layout=obj.layout)
        head = obj.context.cache_offset
        _require(out.getvalue()[:head] == data[:head], "write_session_file does not reproduce the header")
    else:
        _require(isinstance(obj, statefile.SequenceFile), f"{type(obj).__name__} for a sequence file")
        n = len(obj.tokens)
        _require(obj.cache_offset == 12 + 4 * n and bytes(obj.cache) == data[obj.cache_offset:],
                 "the sequence file's parts do not tile the input")
        out = io.BytesIO()
        statefile.write_sequence_file(out, _empty_cache(), 0, obj.tokens, layout=obj.layout)
        _require(out.getvalue()[:obj.cache_offset] == data[:obj.cache_offset],
                 "write_sequence_file does not reproduce the header")


def test_inspect(data: bytes) -> None:
    for variant in (None,) + inspect.VARIANTS:
        try:
            r = inspect.report_bytes(data, variant)
        except StateError:
            continue
        _require(r["size"] == len(data), "the report's size is not the input's")
        b = r["bytes"]
        _require(b["wrapper"] + b["framing"] + b["cache"] == r["size"], "wrapper + framing + cache bytes != size")
        _require(sum(s["size"] for s in r["sections"]) == b["cache"], "the sections do not tile the cache state")
        inspect.format_report(r)
        json.dumps(r)


TARGETS = {"unified": test_unified, "unified2026": test_unified2026, "recurrent": test_recurrent, "statefile": test_statefile,
           "inspect": test_inspect}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [corpus dirs]")
    if atheris is None:
        sys.exit("atheris is not installed (pip install atheris)")
    target = TARGETS[argv[1]]
    atheris.Setup([argv[0]] + argv[2:], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
