"""Build the seed corpora of the libFuzzer targets in tests/fuzz from real blobs.

Sources: the state blobs of the golden traces (``hex`` of ``state_read`` ops and of
``state_write`` expectations), the ``split`` ops of the split traces, the blobs written by
llama.cpp in ``tests/data/interop`` and ``tests/data/interop-v10`` (0.3.36: layout "2026", fed to
the unified target in its layouts mode and to fuzz_state2026, ``llama_fa0_streams`` into a cache
with a stream per sequence; see the READMEs for the layouts), and, when kvcache is importable
(``PYTHONPATH=src`` after an in-place build), states and hand-off headers written by kvcache
itself from caches of both semantics, one stream or several, with and without a sliding window
(fuzz_state2026, fuzz_handoff), and states of caches of semantics 2026 with the per-cell extension
(x, y and token ids set by the placements) in each layout that holds it, plus a state without it
read into such a cache (fuzz_state2026); and for fuzz_framing the states of tests/framing_inputs.py
(a header byte and the blob). Each seed is the target's
header (which picks a cache geometry the blob fits, the destination sequence and a prefill seed)
followed by the blob; see the comment at the top of each fuzz_*.c for the header layout.

    python tests/fuzz/make_corpus.py [--shared DIR] [--out tests/fuzz/corpus]

Seeds that cannot be expressed in a target's header (a geometry outside its choices) are
skipped. File names are the SHA-1 of the content, as libFuzzer names its own finds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TYPE_IDS = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}
TYPE_INDEX = {0: 0, 1: 1, 30: 2, 8: 3}  # ggml id -> position in the targets' type lists
UNIFIED_SIZES = [32, 64, 96, 128, 256, 512, 1024, 4096]
PREFILL_SEEDS = (0, 0x5A)  # an empty cache and one filled with a mix of operations


def type_id(t) -> int:
    return TYPE_IDS[t] if isinstance(t, str) else int(t)


# --- unified -------------------------------------------------------------------------------

def unified_width_byte(tid: int, w: int) -> int | None:
    if tid == 8:
        return w // 32 - 1 if w in (32, 64) else None
    return w - 1 if 1 <= w <= 64 else None


def unified_widths(tk: int, tv: int, ek, ev) -> list[int] | None:
    if len(ek) > 3:
        return None
    widths = []
    for l in range(3):
        k = unified_width_byte(tk, ek[l]) if l < len(ek) else 0
        v = unified_width_byte(tv, ev[l]) if l < len(ev) else 0
        if k is None or v is None:
            return None
        widths += [k, v]
    return widths


def unified_header(parts: list[dict], seq_id: int, prefill: int, flags: int = 0) -> bytes | None:
    """The fuzz_unified_state header for one or two caches (the second shares the first's
    types, V layout and n_seq_max, as the halves of an iSWA cache), or None when the geometry
    has no encoding. flags: bit 4 convert V, bit 5 exact (as in the header's byte 4)."""
    g0 = parts[0]
    tk, tv = type_id(g0["type_k"]), type_id(g0["type_v"])
    v_trans, n_seq_max = bool(g0["v_trans"]), g0["n_seq_max"]
    if tk not in TYPE_INDEX or tv not in TYPE_INDEX or not 1 <= n_seq_max <= 32 or (v_trans and tv == 8):
        return None
    sizes, layer_bytes = [], []
    for g in parts:
        if g["kv_size"] not in UNIFIED_SIZES or len(g["ek"]) > 3:
            return None
        w = unified_widths(tk, tv, g["ek"], g["ev"])
        if w is None:
            return None
        sizes.append(UNIFIED_SIZES.index(g["kv_size"]))
        layer_bytes.append(w)
    b0 = TYPE_INDEX[tk] | TYPE_INDEX[tv] << 2 | int(v_trans) << 4 | len(g0["ek"]) << 5
    b1 = sizes[0] | (n_seq_max - 1) << 3
    b4 = flags | (0x40 if len(parts) == 2 else 0)
    second = [sizes[1] | len(parts[1]["ek"]) << 3] + layer_bytes[1] if len(parts) == 2 else [0] * 7
    return bytes([b0, b1, seq_id + 1, prefill, b4] + layer_bytes[0] + second)


# --- caches of either semantics (fuzz_cache.h: fuzz_state2026, fuzz_handoff) ---------------

CACHE_SIZES = [32, 64, 96, 128, 256, 512, 1024, 2048]


def cache_geometry(geo: dict, prefill: int, flags: int, *, today: bool = True, streams: bool = False,
                   swa: tuple[str, int] | None = None) -> bytes | None:
    """The 11 geometry bytes of fuzz_cache.h (byte 4 = flags), or None when the geometry has no
    encoding. geo as for unified_header (plus cell_ext, ple: the per-cell extension, and every
    placement setting it); swa: (type, n_swa) of a sliding window."""
    tk, tv = type_id(geo["type_k"]), type_id(geo["type_v"])
    v_trans, n_seq_max, n_layer = bool(geo["v_trans"]), geo["n_seq_max"], len(geo["ek"])
    if tk not in TYPE_INDEX or tv not in TYPE_INDEX or (v_trans and tv == 8) or not 1 <= n_layer <= 3:
        return None
    if geo["kv_size"] not in CACHE_SIZES or not 1 <= n_seq_max <= 4:
        return None
    w = unified_widths(tk, tv, geo["ek"], geo["ev"])
    if w is None:
        return None
    b0 = TYPE_INDEX[tk] | TYPE_INDEX[tv] << 2 | int(v_trans) << 4 | (n_layer - 1) << 5
    b1 = CACHE_SIZES.index(geo["kv_size"]) | (n_seq_max - 1) << 3 | int(today) << 5 | int(streams) << 6
    b2 = int(bool(geo.get("cell_ext"))) << 6 | int(bool(geo.get("ple"))) << 7
    if swa is not None:
        kind, n_swa = swa
        if not 1 <= n_swa <= 32:
            return None
        b1 |= 0x80
        b2 |= (n_swa - 1) | int(kind == "chunked") << 5
    return bytes([b0, b1, b2, prefill, flags] + w)


STATE2026_DETECT, STATE2026_STREAMS, STATE2026_CONVERT = 0x40, 0x80, 0x10
# byte 11 of fuzz_state2026: the extension's bytes added to a given layout (x y; x y tok)
STATE2026_EXT = {0: 0, 8: 0x08, 12: 0x18}


def add_state2026(corpus: Corpus, geo: dict, seq_id: int, blob: bytes, *, streams: bool = False,
                  swa: tuple[str, int] | None = None, layouts=(STATE2026_DETECT, STATE2026_STREAMS),
                  ext: int = 0) -> None:
    """The blob into a 2026 cache of its geometry, in each of `layouts` (byte 4 of the header),
    and into one of the other V layout with conversion; ext: bytes of the per-cell extension in
    the blob's cell records (a given layout says so)."""
    seeds = [(geo, prefill, lay) for prefill in PREFILL_SEEDS for lay in layouts]
    if type_id(geo["type_v"]) != 8:
        seeds.append((dict(geo, v_trans=not geo["v_trans"]), 0, layouts[0] | STATE2026_CONVERT))
    for g, prefill, flags in seeds:
        h = cache_geometry(g, prefill, flags, streams=streams, swa=swa)
        if h is not None:
            corpus.add("fuzz_state2026", h + bytes([seq_id + 1 | STATE2026_EXT[ext]]) + blob)


HANDOFF_COMMIT, HANDOFF_FIX_SUM, HANDOFF_NOISE = 0x10, 0x20, 0x40


def add_handoff(corpus: Corpus, geo: dict, header: bytes, seq_id: int, *, today: bool, streams: bool,
                swa: tuple[str, int] | None = None) -> None:
    """An exported header into a cache of its geometry: aborted, committed with noise in the
    regions, and committed into another sequence (-1: the header's own id)."""
    for prefill, flags, dst in ((0, 0, -1), (0x5A, HANDOFF_COMMIT | HANDOFF_NOISE | HANDOFF_FIX_SUM, -1),
                                (0, HANDOFF_COMMIT | HANDOFF_FIX_SUM, (seq_id + 1) % geo["n_seq_max"])):
        h = cache_geometry(geo, prefill, flags, today=today, streams=streams, swa=swa)
        if h is not None:
            corpus.add("fuzz_handoff", h + bytes([dst + 1]) + header)


# shapes of the kvcache-written seeds: (semantics 2026, kv_unified false, window, types, V transposed)
WRITTEN_SHAPES = (
    (True, False, None, ("f16", "f16"), True),
    (True, False, None, ("f32", "q8_0"), False),
    (True, True, None, ("f16", "f16"), True),
    (True, True, None, ("bf16", "f16"), False),
    (True, False, ("standard", 8), ("f16", "f16"), True),
    (True, True, ("chunked", 16), ("f16", "f16"), False),
    (False, False, None, ("f16", "f16"), True),
    (False, False, ("standard", 8), ("q8_0", "f32"), True),
)


# shapes of the kvcache-written seeds with the per-cell extension (semantics 2026): (kv_unified
# false, window, types, V transposed, ple_token: placements without token ids store it)
EXT_SHAPES = (
    (False, None, ("f16", "f16"), True, None),
    (True, None, ("f32", "f16"), False, None),
    (False, ("standard", 8), ("f16", "f16"), False, None),
    (True, ("chunked", 16), ("bf16", "f16"), True, 262144),  # FC_PLE_TOKEN of fuzz_cache.h
)
# ext bytes of the layouts with the extension, and the header bits that give those layouts
EXT_LAYOUTS = (("2026-03", 8), ("2026-05", 8), ("2026-06", 8), ("2026", 12))


def written_cache(kvcache, np, rng, *, today: bool, streams: bool, swa, types, v_trans: bool,
                  ext: bool = False, ple_token=None):
    """A cache of one of the shapes above filled as the seeds want it: three sequences over
    interleaved positions, a stream copy and a removal; with the extension, every other placement
    with 2-D positions and token ids (x, y, tok off their defaults). Returns (cache, geo)."""
    tk, tv = types
    ek, ev = [32, 8], [16, 32] if tk != "q8_0" and tv != "q8_0" else [32, 32]
    if tk == "q8_0" or tv == "q8_0":
        ek = [32, 64]
    n_seq = 3
    kw = dict(cell_ext=True, ple_token=ple_token) if ext else {}
    c = kvcache.UnifiedCache(64, 2, ek, ev, type_k=tk, type_v=tv, v_trans=v_trans, n_seq_max=n_seq,
                             n_swa=swa[1] if swa else 0, swa_type=swa[0] if swa else "none",
                             semantics="2026" if today else "2025", kv_unified=not streams, **kw)
    for il in c.layers:
        for a in (c.k(il), c.v(il)):
            a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(a.view(np.uint8).shape)
    for step in range(6):
        for s in range(n_seq):
            n = 1 + (step + s) % 4
            p0 = sum(1 + (k + s) % 4 for k in range(step))
            pos = list(range(p0, p0 + n))
            more = {}
            if ext and (step + s) % 2 == 0:
                more = dict(pos_x=[p % 5 + s for p in pos], pos_y=[p // 5 + 1 for p in pos],
                            tokens=[1000 * (s + 1) + p for p in pos])
            ub = kvcache.UBatch(pos=pos, seq_id=[s] * n, **more)
            if c.find_slot(ub) and not today:
                c.commit()
    c.seq_rm(1, 2, 5)
    c.seq_cp(0, 2, -1, -1) if streams else c.seq_cp(0, 2, 0, 4)
    c.update()
    geo = dict(type_k=tk, type_v=tv, v_trans=v_trans, kv_size=64, n_seq_max=n_seq, ek=ek, ev=ev,
               cell_ext=ext, ple=ple_token is not None)
    return c, geo


def from_kvcache(corpus: Corpus) -> None:
    """States and hand-off headers written by kvcache itself (caches of the shapes above)."""
    try:
        import numpy as np
        import kvcache
    except ImportError as e:  # the package is not built: no such seeds
        print(f"kvcache not importable ({e}); no kvcache-written seeds", file=sys.stderr)
        return
    rng = np.random.default_rng(7)
    for today, streams, swa, types, v_trans in WRITTEN_SHAPES:
        c, geo = written_cache(kvcache, np, rng, today=today, streams=streams, swa=swa, types=types, v_trans=v_trans)
        n_seq = geo["n_seq_max"]
        for s in range(n_seq):
            add_handoff(corpus, geo, c.seq_export(s).header, s, today=today, streams=streams, swa=swa)
        if not today:
            continue
        layouts = ("2026", "2025") if not streams else ("2026",)
        for layout in layouts:
            flags = (STATE2026_DETECT, STATE2026_STREAMS) if layout == "2026" else (STATE2026_DETECT, 0)
            for s in (-1, *range(n_seq)):
                add_state2026(corpus, geo, s, c.state_write(s, layout=layout), streams=streams, swa=swa,
                              layouts=flags)
    for streams, swa, types, v_trans, ple_token in EXT_SHAPES:
        c, geo = written_cache(kvcache, np, rng, today=True, streams=streams, swa=swa, types=types,
                               v_trans=v_trans, ext=True, ple_token=ple_token)
        # the same steps without the extension: its states read into the cache with it (defaults)
        plain, _ = written_cache(kvcache, np, rng, today=True, streams=streams, swa=swa, types=types,
                                 v_trans=v_trans)
        for s in (-1, *range(geo["n_seq_max"])):
            for layout, ext in EXT_LAYOUTS:
                add_state2026(corpus, geo, s, c.state_write(s, layout=layout), streams=streams, swa=swa,
                              ext=ext)
            add_state2026(corpus, geo, s, plain.state_write(s, layout="2025-08"), streams=streams, swa=swa)

    # hand-off headers of caches with the per-cell extension (token ids and 2-D positions)
    for streams in (False, True):
        c = kvcache.UnifiedCache(64, 2, [32, 8], [16, 32], type_k="f16", type_v="f16", v_trans=not streams,
                                 n_seq_max=3, semantics="2026", kv_unified=not streams, cell_ext=True)
        for step in range(4):
            for s in range(3):
                n, p0 = 2 + s, step * 4
                ext = {"tokens": [100 * s + step + t for t in range(n)]} if (step + s) % 3 else {}
                if (step + s) % 2:
                    ext.update(pos_x=[p0 + t % 2 for t in range(n)], pos_y=[p0 + t // 2 for t in range(n)])
                assert c.find_slot(kvcache.UBatch(pos=list(range(p0, p0 + n)), seq_id=[s] * n, **ext))
        geo = dict(type_k="f16", type_v="f16", v_trans=not streams, kv_size=64, n_seq_max=3, ek=[32, 8], ev=[16, 32],
                   cell_ext=True)
        for s in range(3):
            add_handoff(corpus, geo, c.seq_export(s).header, s, today=True, streams=streams)


# --- recurrent -----------------------------------------------------------------------------

def recurrent_width(tid: int, w: int) -> int | None:
    if tid == 8:
        return w // 32 if w % 32 == 0 and w // 32 < 128 else None
    return w if w < 4096 else None


def recurrent_header(tk, tv, kv_size, n_seq_max, ek, ev, seq_id, prefill) -> bytes | None:
    tk, tv = type_id(tk), type_id(tv)
    if tk not in TYPE_INDEX or tv not in TYPE_INDEX or not 1 <= len(ek) <= 4:
        return None
    if not 1 <= kv_size <= 16 or not 0 <= n_seq_max <= min(kv_size, 15):
        return None
    out = bytes([TYPE_INDEX[tk] | TYPE_INDEX[tv] << 2 | (len(ek) - 1) << 4,
                 (kv_size - 1) | n_seq_max << 4, seq_id + 1, prefill])
    for l in range(4):
        k = recurrent_width(tk, ek[l]) if l < len(ek) else 0
        v = recurrent_width(tv, ev[l]) if l < len(ev) else 0
        if k is None or v is None:
            return None
        out += struct.pack("<HH", k, v)
    return out


# --- batch ---------------------------------------------------------------------------------

MODES = {"simple": 0, "equal": 1, "seq": 2}


def batch_input(op: dict) -> bytes | None:
    pos, seq_id, logits = op["pos"], op["seq_id"], op.get("logits")
    if len(pos) > 1024 or any(p >= 240 or p < 0 for p in pos):
        return None
    if any(not 1 <= len(ids) <= 3 or any(not 0 <= s < 64 for s in ids) for ids in seq_id):
        return None
    mode = MODES[op["mode"]]
    n_ub = op["n_ubatch"]
    flags = (int(op["simple_split"]) | int(bool(op.get("logits_all"))) << 1 | int(logits is not None) << 2
             | int(mode == 2) << 3 | (min(n_ub, 16) - 1) << 4)
    out = bytearray([flags]) + struct.pack("<H", len(pos))
    for t, p in enumerate(pos):
        out.append(len(seq_id[t]) | (int(bool(logits[t])) << 2 if logits is not None else 0))
        out.append(p)
        out += bytes(seq_id[t])
    # the trace's own calls first (n_ubatch capped to what one byte holds), then the drain
    n_calls = len(op["expect"].get("ubatches", [])) if isinstance(op.get("expect"), dict) else 1
    out += bytes([mode | min(n_ub, 63) << 2] * max(1, n_calls))
    return bytes(out)


# --- sources -------------------------------------------------------------------------------

def golden_ops(path: Path):
    with open(path) as f:
        header = json.loads(f.readline())
        for line in f:
            yield header["config"], json.loads(line)


def golden_blobs(path: Path):
    """(seq_id, blob) of every state_read op and every state_write expectation with hex."""
    for config, op in golden_ops(path):
        if op["op"] == "state_read":
            yield op["seq_id"], bytes.fromhex(op["hex"])
        elif op["op"] == "state_write" and "hex" in op.get("expect", {}):
            yield op["seq_id"], bytes.fromhex(op["expect"]["hex"])


def context_cache_offset(blob: bytes, off: int = 0) -> int:
    """Where the cache state starts in a whole-context state (llama_state_get_data)."""
    (n,) = struct.unpack_from("<I", blob, off)
    p = off + 4 + n
    (n_out,) = struct.unpack_from("<I", blob, p)
    p += 4 + 4 * n_out
    (n_logits,) = struct.unpack_from("<Q", blob, p)
    p += 8 + 4 * n_logits
    (n_embd,) = struct.unpack_from("<Q", blob, p)
    return p + 8 + 4 * n_embd


def file_token_skip(blob: bytes) -> int:
    """Bytes before the state in a session (.ggsn) or sequence (.ggsq) file."""
    _, _, n_tokens = struct.unpack_from("<III", blob, 0)
    return 12 + 4 * n_tokens


def interop_blobs(folder: Path, today: bool = False):
    """(seq_id, cache state bytes) of every blob in an interop folder (today: written by 0.3.36,
    whose whole-context states hold the architecture name alone before the memory state)."""
    for f in sorted(folder.iterdir()):
        if f.suffix not in (".bin", ".ggsq", ".ggsn"):
            continue
        data = f.read_bytes()
        if today and f.name == "state.bin":
            yield -1, data[4 + struct.unpack_from("<I", data)[0]:]
        elif today and f.suffix == ".ggsn":
            skip = file_token_skip(data)
            yield -1, data[skip + 4 + struct.unpack_from("<I", data, skip)[0]:]
        elif f.name == "state.bin":
            yield -1, data[context_cache_offset(data):]
        elif f.suffix == ".ggsn":
            yield -1, data[context_cache_offset(data, file_token_skip(data)):]
        elif f.suffix == ".ggsq":
            yield int(f.stem[3:]), data[file_token_skip(data):]
        else:
            yield int(f.stem[3:]), data


class Corpus:
    def __init__(self, out: Path):
        self.out = out
        self.counts: dict[str, int] = {}

    def add(self, target: str, data: bytes) -> None:
        d = self.out / target
        d.mkdir(parents=True, exist_ok=True)
        path = d / hashlib.sha1(data).hexdigest()
        if not path.exists():
            path.write_bytes(data)
            self.counts[target] = self.counts.get(target, 0) + 1


def add_unified(corpus: Corpus, parts: list[dict], seq_id: int, blob: bytes, flags: int = 0) -> None:
    for prefill in PREFILL_SEEDS:
        h = unified_header(parts, seq_id, prefill, flags)
        if h is not None:
            corpus.add("fuzz_unified_state", h + blob)
    # the same blob into caches of the other V layout, converted on the way in
    flipped = [dict(g, v_trans=not g["v_trans"]) for g in parts]
    h = unified_header(flipped, seq_id, 0, flags=0x10 | flags)
    if h is not None:
        corpus.add("fuzz_unified_state", h + blob)


def add_recurrent(corpus: Corpus, geo: dict, seq_id: int, blob: bytes) -> None:
    for prefill in PREFILL_SEEDS:
        h = recurrent_header(geo["type_k"], geo["type_v"], geo["kv_size"], geo["n_seq_max"], geo["ek"], geo["ev"],
                             seq_id, prefill)
        if h is not None:
            corpus.add("fuzz_recurrent_state", h + blob)


def from_golden(corpus: Corpus, golden: Path) -> None:
    for path in sorted((golden / "unified").glob("*.jsonl")):
        config = json.loads(path.open().readline())["config"]
        kept = config["layers"]
        geo = dict(type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
                   kv_size=config["kv_size"], n_seq_max=config["n_seq_max"],
                   ek=[config["n_embd_k_gqa"][il] for il in kept], ev=[config["n_embd_v_gqa"][il] for il in kept])
        for seq_id, blob in golden_blobs(path):
            add_unified(corpus, [geo], seq_id, blob)
    for path in sorted((golden / "iswa").glob("*.jsonl")):
        config = json.loads(path.open().readline())["config"]
        swa = set(config["swa_layers"])
        parts = []
        for is_swa, size in ((False, config["size_base"]), (True, config["size_swa"])):
            kept = [il for il in config["layers"] if (il in swa) == is_swa]
            parts.append(dict(type_k=config["type_k"], type_v=config["type_v"], v_trans=config["v_trans"],
                              kv_size=size, n_seq_max=config["n_seq_max"],
                              ek=[config["n_embd_k_gqa"][il] for il in kept],
                              ev=[config["n_embd_v_gqa"][il] for il in kept]))
        for seq_id, blob in golden_blobs(path):
            add_unified(corpus, parts, seq_id, blob)  # base part, then SWA part
    for path in sorted((golden / "recurrent").glob("*.jsonl")):
        config = json.loads(path.open().readline())["config"]
        geo = dict(type_k=config["type_k"], type_v=config["type_v"], kv_size=config["kv_size"],
                   n_seq_max=config["n_seq_max"], ek=config["n_embd_k_gqa"], ev=config["n_embd_v_gqa"])
        for seq_id, blob in golden_blobs(path):
            add_recurrent(corpus, geo, seq_id, blob)
    for path in sorted((golden / "split").glob("*.jsonl")):
        for _, op in golden_ops(path):
            if op["op"] == "split":
                data = batch_input(op)
                if data is not None:
                    corpus.add("fuzz_batch_split", data)


ATHERIS_FILES = ("seq1.bin", "seq3.bin", "state.bin", "seq0.ggsq", "session.ggsn")


def from_interop(corpus: Corpus, interop: Path, today: bool = False) -> None:
    """today: the blobs of 0.3.36 (their sequence blobs start with the prefix, which the recurrent
    target does not read: it gets the memory state after it)."""
    for folder in sorted(p for p in interop.iterdir() if p.is_dir() and p.name != "models"):
        if folder.name != "llama_bf16_fa1":  # the same layouts as llama_fa1
            # whole files for the state-file and inspect targets (atheris_state.py)
            for name in ATHERIS_FILES:
                if (folder / name).exists():
                    corpus.add("atheris_files", (folder / name).read_bytes())
        manifest = json.loads((folder / "state.bin.json").read_text())
        ctx = manifest["context"]
        if manifest["memory_kind"] == "recurrent":
            (g,) = manifest["geometry"]
            geo = dict(type_k=g["layers"][0]["r_type"], type_v=g["layers"][0]["s_type"], kv_size=g["mem_size"],
                       n_seq_max=ctx["n_seq_max"], ek=[l["n_embd_r"] for l in g["layers"]],
                       ev=[l["n_embd_s"] for l in g["layers"]])
            for seq_id, blob in interop_blobs(folder, today):
                if today and blob[:4] == struct.pack("<I", 0xAF143CD8):
                    blob = blob[8:]
                add_recurrent(corpus, geo, seq_id, blob)
            continue
        geos = [dict(type_k=g["layers"][0]["type_k"], type_v=g["layers"][0]["type_v"], v_trans=g["v_trans"],
                     kv_size=g["kv_size"], n_seq_max=ctx["n_seq_max"],
                     ek=[l["n_embd_k_gqa"] for l in g["layers"]], ev=[l["n_embd_v_gqa"] for l in g["layers"]])
                for g in manifest["geometry"]]
        for seq_id, blob in interop_blobs(folder, today):
            # iSWA: the base part, then the SWA part; today's layouts in the target's layouts mode
            add_unified(corpus, geos, seq_id, blob, 0x80 if today else 0)
            if today and len(geos) == 1:
                add_state2026(corpus, geos[0], seq_id, blob, streams=not ctx.get("kv_unified", True))


def from_hybrid(corpus: Corpus, interop: Path | None = None) -> None:
    """fuzz_hybrid_state: states kvcache's HybridCache writes in the target's geometries (its
    header: docs at the top of fuzz_hybrid_state.c), whole and per sequence, both parts and the
    recurrent part alone, with and without a sliding window; atheris_files: the hybrid model's files
    of 0.3.36 (interop-hybrid)."""
    if interop is not None and (interop / "lfm2_a").is_dir():
        for name in ATHERIS_FILES + ("seq0.partial_only.bin",):
            corpus.add("atheris_files", (interop / "lfm2_a" / name).read_bytes())
    try:
        import numpy as np

        import kvcache
    except ImportError:
        print("kvcache is not importable: no fuzz_hybrid_state seeds", file=sys.stderr)
        return
    for falcon, n_seq_max, streams, rs, wbyte, window in ((0, 2, 0, 0, 0x13, 0), (0, 4, 1, 1, 0x01, 0),
                                                          (1, 3, 0, 1, 0x22, 0), (0, 2, 0, 1, 0x13, 1),
                                                          (1, 2, 1, 0, 0x01, 1)):
        ek, er = 4 * (1 + (wbyte & 15)), 2 * (1 + (wbyte >> 4))
        n_layer, recr, attn = (2, [0], [0, 1]) if falcon else (3, [0, 2], [1])
        # the target's window (2 + bits 0-1 of its third byte, 7 below: 5) on the last attention layer
        iswa = dict(n_swa=5, swa_layers=attn[-1:], swa_full=False) if window else {}
        h = kvcache.HybridCache(32, n_layer, recr, ek, ek, er, 2, n_seq_max=n_seq_max, attn_layers=attn,
                                kv_unified=not streams, n_rs_seq=2 if rs else 0, **iswa)
        rng = np.random.default_rng(n_seq_max)
        for s, n in ((0, 5), (n_seq_max - 1, 3), (0, 2)):
            p0 = h.seq_pos_max(s) + 1
            for ub in h.ubatches(list(range(p0, p0 + n)), [s] * n, 4):
                assert h.find_slot(ub)
                for il in attn:
                    h.store(il, rng.standard_normal((ub.n_tokens, ek)).astype(np.float16),
                            rng.standard_normal((ub.n_tokens, ek)).astype(np.float16))
                for il in recr:
                    h.store_state(il, rng.standard_normal((1, er)).astype(np.float32),
                                  rng.standard_normal((1, 2)).astype(np.float32))
        bits = (n_seq_max - 1) | streams << 2 | rs << 3 | falcon << 7
        third = 7 if window else 0
        for seq in range(-1, n_seq_max):
            corpus.add("fuzz_hybrid_state", bytes([bits | 1 << 6, (seq + 1) % (n_seq_max + 1) | window << 7, third,
                                                   wbyte]) + h.state_write(seq))
            if seq >= 0:
                corpus.add("fuzz_hybrid_state", bytes([bits | 1 << 4, seq + 1 | window << 7, 7, wbyte])
                           + h.state_write(seq, partial_only=True))


def from_framing(corpus: Corpus) -> None:
    """fuzz_framing: the states of tests/framing_inputs.py up to 16 KiB (llama.cpp's, the golden
    traces', and those kvcache writes from every kind of cache, hybrid with a sliding window too),
    with the prefix allowed; those that start with it also without."""
    try:
        import numpy as np

        import kvcache
    except ImportError:
        print("kvcache is not importable: no fuzz_framing seeds", file=sys.stderr)
        return
    sys.path.insert(0, str(HERE.parent))
    import framing_inputs

    for _, blob, _, _ in framing_inputs.bases(kvcache, np):
        if len(blob) <= 16384:
            corpus.add("fuzz_framing", b"\x01" + blob)
            if blob[:4] == struct.pack("<I", 0xAF143CD8):
                corpus.add("fuzz_framing", b"\x00" + blob)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=REPO / "tests" / "data",
                    help="the folder that holds interop/ and interop-v10/; default tests/data")
    ap.add_argument("--golden", type=Path, default=REPO / "tests" / "golden")
    ap.add_argument("--out", type=Path, default=HERE / "corpus")
    args = ap.parse_args(argv)
    shared = args.shared
    corpus = Corpus(args.out)
    from_golden(corpus, args.golden)
    if (shared / "interop").is_dir():
        from_interop(corpus, shared / "interop")
        if (shared / "interop-v10").is_dir():
            from_interop(corpus, shared / "interop-v10", today=True)
    else:
        print(f"no interop blobs under {shared}; golden seeds only", file=sys.stderr)
    from_kvcache(corpus)
    from_hybrid(corpus, shared / "interop-hybrid")
    from_framing(corpus)
    for target, n in sorted(corpus.counts.items()):
        print(f"{target}: {n} new seeds")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"corpus size: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
