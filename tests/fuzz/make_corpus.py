"""Build the seed corpora of the libFuzzer targets in tests/fuzz from real blobs.

Sources: the state blobs of the golden traces (``hex`` of ``state_read`` ops and of
``state_write`` expectations), the ``split`` ops of the split traces, and the blobs written by
llama.cpp in ``../shared/interop`` and ``../shared/interop-v10`` (0.3.36: layout "2026", fed to the
unified target in its layouts mode; see the READMEs for the layouts). Each seed is the target's
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared",
                    help="the shared reference folder (holds interop/); default ../shared")
    ap.add_argument("--golden", type=Path, default=REPO / "tests" / "golden")
    ap.add_argument("--out", type=Path, default=HERE / "corpus")
    args = ap.parse_args(argv)
    shared = args.shared if args.shared.exists() else Path("/work/shared")
    corpus = Corpus(args.out)
    from_golden(corpus, args.golden)
    if (shared / "interop").is_dir():
        from_interop(corpus, shared / "interop")
        if (shared / "interop-v10").is_dir():
            from_interop(corpus, shared / "interop-v10", today=True)
    else:
        print(f"no interop blobs under {shared}; golden seeds only", file=sys.stderr)
    for target, n in sorted(corpus.counts.items()):
        print(f"{target}: {n} new seeds")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"corpus size: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
