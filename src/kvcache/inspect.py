"""``kvcache inspect FILE [--json]``: what a state file is and what it holds.

The kind is detected from the content: a session file (``ggsn``), a sequence file (``ggsq``), a
whole-context state (``llama_state_get_data``: it starts with the architecture name) or a bare
cache state (``state_write`` / ``llama_state_seq_get_data``: a sequence blob or a whole-cache
blob). The cache variant (unified, iSWA: two cache states back to back, recurrent, hybrid: an
attention part then a recurrent part) is given with ``--variant`` or guessed. The cache states are decoded by the C codec
(:func:`kvcache._core.describe_state`), the wrappers by :mod:`kvcache.statefile`.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Mapping

import numpy as np

from kvcache._core import StateError
from kvcache._text import plural

__all__ = ["VARIANTS", "CacheStateError", "report", "report_bytes", "format_report", "main"]

VARIANTS = ("unified", "iswa", "recurrent", "hybrid")

# architectures whose memory is a recurrent cache in llama.cpp (for the guess from a context state)
_RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
# ... and a hybrid memory (kvcache.geometry's hybrid architectures)
_HYBRID_ARCHS = {"lfm2", "granitehybrid", "jamba", "falcon-h1", "nemotron_h", "qwen3next", "plamo2"}

GGUF_MAGIC = b"GGUF"
SEQ_MAGIC_BYTES = (0xAF143CD8).to_bytes(4, "little")

KINDS = {"session": "session file", "sequence": "sequence file", "context": "whole-context state",
         "cache": "cache state", "blob": "2026 sequence blob"}

# what a state file starts with, for the bytes that start like none
NOT_A_STATE = ("not a state file: it starts with no state file's magic (session file 'ggsn', sequence file 'ggsq', "
               "2026 sequence blob 0xaf143cd8) and does not read as a whole-context or cache state")


class CacheStateError(StateError):
    """The cache state inside a file could not be read: a StateError that also says what kind
    of file held it (``kind``, a key of KINDS) and where its cache state starts (``base``: the
    codec's byte offsets count from there)."""

    def __init__(self, message: str, kind: str, base: int):
        super().__init__(message)
        self.kind = kind
        self.base = base


def _ranges(pos: np.ndarray) -> list:
    """Sorted distinct positions as [first, last] runs of consecutive values."""
    if pos.size == 0:
        return []
    p = np.unique(pos.astype(np.int64))
    breaks = np.flatnonzero(np.diff(p) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [p.size - 1]))
    return [[int(p[a]), int(p[b])] for a, b in zip(starts, ends)]


def _section(name: str, desc: Mapping[str, Any], offset: int, seq_id: int | None = None) -> dict[str, Any]:
    """One cache state's report; seq_id: the sequence a prefix names (a recurrent single-sequence
    state's cells carry no id of their own), or None."""
    from kvcache._core import MAX_SEQ, ggml_type_name

    pos, seq = desc["pos"], desc["seq"]          # seq: [cells, words], bit b of word w is id 64 w + b
    sequences = {}
    for s in range(MAX_SEQ):
        has = (seq[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1) == 1
        if has.any():
            sequences[str(s)] = _ranges(pos[has])
    no_id = ~seq.any(axis=1)
    if no_id.any():
        # recurrent single-sequence states carry no id: the reader gives the destination's; a
        # sequence-blob prefix names the source's
        sequences["unnamed" if seq_id is None else str(seq_id)] = _ranges(pos[no_id])
    layers = []
    for i, l in enumerate(desc["layers"]):
        e = {"index": i, "k_type": ggml_type_name(l["k_type"]) or f"unknown ({l['k_type']})",
             "k_type_id": l["k_type"], "k_row_size": l["k_row_size"], "k_bytes": l["k_bytes"],
             "v_type": ggml_type_name(l["v_type"]) or f"unknown ({l['v_type']})", "v_type_id": l["v_type"]}
        if desc["v_trans"]:
            e["v_elem_size"] = l["v_elem_size"]
            e["v_width"] = l["v_width"]
        else:
            e["v_row_size"] = l["v_row_size"]
        e["v_bytes"] = l["v_bytes"]
        layers.append(e)
    return {
        "name": name,
        "offset": offset,
        "size": desc["size"],
        "cell_count": desc["cell_count"],
        "v_trans": bool(desc["v_trans"]),
        "n_layer": desc["n_layer"],
        "n_seq_id": [desc["n_seq_id_min"], desc["n_seq_id_max"]],
        "sequences": sequences,
        "layers": layers,
    }


def _empty_section(name: str, offset: int) -> dict[str, Any]:
    """A stream section without cells: its cell count alone (the layouts with stream counts)."""
    return {"name": name, "offset": offset, "size": 4, "cell_count": 0, "v_trans": False, "n_layer": 0,
            "n_seq_id": [0, 0], "sequences": {}, "layers": []}


def _pick_framing(part: memoryview, variant: str | None, arch: str | None, streams: bool | None,
                  allow_prefix: bool):
    """The one framing of part that fits what is known (variant, the layout's stream counts),
    or None; and why part is not framed as each (streams, n_parts) it is not (statefile._framings)."""
    from kvcache.statefile import _framings

    recurrent = variant == "recurrent" or (variant is None and (arch or "").lower() in _RECURRENT_ARCHS)
    hybrid = variant == "hybrid" or (variant is None and (arch or "").lower() in _HYBRID_ARCHS)
    cands = []
    framings, errors = _framings(part, allow_prefix)
    for f in framings:
        if bool(f.recurrent_records) != hybrid:
            if hybrid or variant is not None:
                continue
            cands.append(f)     # a hybrid memory's framing: only when no other fits (listed last)
            continue
        if hybrid:
            cands.append(f)
            continue
        if recurrent and f.streams:
            continue  # a recurrent memory state has no stream count in any layout
        if streams is not None and f.streams != streams and not recurrent and not (not f.streams and
                                                                                      variant is None):
            continue
        if variant == "iswa" and len(f.parts) != 2 or variant in ("unified", "recurrent") and len(f.parts) != 1:
            continue
        cands.append(f)
    if streams is not None:
        cands.sort(key=lambda f: f.streams != streams)
    cands.sort(key=lambda f: bool(f.recurrent_records) != hybrid)
    return (cands[0] if cands else None), errors


def _cache_sections(part: memoryview, base: int, variant: str | None, arch: str | None,
                    streams: bool | None = None, allow_prefix: bool = False):
    """Describe the cache states in part (at offset base of the file); returns (variant, guessed,
    sections, trailing bytes, framing or None: layout 2025's shape read the old way)."""
    from kvcache._core import describe_state

    framing, errors = _pick_framing(part, variant, arch, streams, allow_prefix)
    recurrent = variant == "recurrent" or (variant is None and (arch or "").lower() in _RECURRENT_ARCHS)
    if framing is None and (allow_prefix and bytes(part[:4]) == SEQ_MAGIC_BYTES or streams and not recurrent):
        # a state of a layout with the prefix or stream counts that reads in no framing: say where
        # it stops making sense (what the walk of that framing found)
        error = errors.get((not recurrent, 2 if variant == "iswa" else 1))
        if error is not None:
            raise error
    if framing is not None and framing.recurrent_records:
        return (*_hybrid_sections(part, base, variant, framing), 0, framing)
    if variant == "hybrid":
        raise StateError("not a hybrid memory's state: it frames neither as an attention part (with its stream "
                         "count) followed by a recurrent part (whose layer count is the model's) nor as a "
                         "recurrent part alone after the sequence-blob prefix")
    if framing is None or not framing.streams and not framing.prefixed:
        return (*_seed_sections(part, base, variant, arch), framing)
    guessed = variant is None
    descs = []
    for k, secs in enumerate(framing.parts):
        for s, (off, n) in enumerate(secs):
            descs.append((k, s, off, None if framing.streams and n == 0 else
                          describe_state(part[off:], framing.cell_ext)))
    if variant is None:
        variant = "iswa" if len(framing.parts) == 2 else "unified"
        # a prefix before a state without stream counts: only a recurrent memory state has none
        # in the layouts with the prefix
        if variant == "unified" and (not framing.streams or (arch or "").lower() in _RECURRENT_ARCHS or
                                     any(d and d["cell_count"] and d["n_seq_id_max"] == 0 for *_, d in descs)):
            variant = "recurrent"
    names = ["base", "swa"] if variant == "iswa" else ["recurrent" if variant == "recurrent" else "kv"]
    sections = []
    for k, s, off, d in descs:
        name = names[k] + (f" stream {s}" if len(framing.parts[k]) > 1 else "")
        if d is None:
            sections.append(_empty_section(name, base + off))
            continue
        if not guessed:
            _check_variant(variant, d)
        sections.append(_section(name, d, base + off, framing.src_seq_id if framing.prefixed else None))
    return variant, guessed, sections, 0, framing


def _hybrid_sections(part: memoryview, base: int, variant: str | None, framing):
    """The sections of a hybrid memory's state: the attention part's streams, then the recurrent
    part (its layer count the model's, records for its recurrent layers only)."""
    from kvcache._core import describe_state

    guessed = variant is None
    src = framing.src_seq_id if framing.prefixed else None
    sections = []
    *attn, (rec,) = framing.parts
    # with a sliding window the attention part is an iSWA pair: its base cache, then its SWA cache
    pair = [" base", " swa"] if len(attn) == 2 else [""]
    for k, secs in enumerate(attn):
        for s, (off, n) in enumerate(secs):
            name = "attention" + pair[k] + (f" stream {s}" if len(secs) > 1 else "")
            if n == 0:
                sections.append(_empty_section(name, base + off))
                continue
            d = describe_state(part[off:])
            _check_variant("unified", d)
            sections.append(_section(name, d, base + off, src))
    off, _ = rec
    d = describe_state(part[off:], 0, framing.recurrent_records)
    _check_variant("recurrent", d)
    sec = _section("recurrent", d, base + off, src)
    sec["layer_records"] = framing.recurrent_records
    sections.append(sec)
    return "hybrid", guessed, sections


def _seed_sections(part: memoryview, base: int, variant: str | None, arch: str | None):
    """The cache states of layout 2025's shape (no stream count, no prefix): (variant, guessed,
    sections, trailing bytes)."""
    from kvcache._core import describe_state

    first = describe_state(part)
    end = first["size"]
    guessed = variant is None
    if variant is None:
        variant = "unified"
        if end < len(part):
            try:
                second = describe_state(part[end:])
            except StateError:
                second = None
            if second is not None and end + second["size"] == len(part):
                variant = "iswa"
        if variant == "unified" and ((arch or "").lower() in _RECURRENT_ARCHS
                                     or (first["cell_count"] and first["n_seq_id_max"] == 0)):
            variant = "recurrent"
    if not guessed:
        _check_variant(variant, first)
    if variant == "iswa":
        if end >= len(part):
            raise StateError(f"the iSWA cache state has its base part only ({end} bytes); the SWA part is missing")
        second = describe_state(part[end:])
        _check_variant(variant, second)
        sections = [_section("base", first, base), _section("swa", second, base + end)]
        end += second["size"]
    else:
        sections = [_section("recurrent" if variant == "recurrent" else "kv", first, base)]
    return variant, guessed, sections, len(part) - end


def _layouts_of(kind: str, variant: str, framing, file_layout: str | None, version: int | None) -> list[str]:
    """The layouts whose writers produce what was found, newest first."""
    from kvcache._core import DEFAULT_LAYOUT, LAYOUTS, layout_info

    out = []
    if variant == "hybrid":
        # a hybrid memory's state exists in today's layout only (kvcache writes and reads no other)
        i = layout_info(DEFAULT_LAYOUT)
        if kind == "session" and version != i["session_version"] or \
                kind == "sequence" and version != i["sequence_version"]:
            return []
        return [DEFAULT_LAYOUT]
    for name in reversed(LAYOUTS):
        i = layout_info(name)
        if kind == "session" and version != i["session_version"] or \
                kind == "sequence" and version != i["sequence_version"]:
            continue
        if kind in ("session", "context") and file_layout is not None and \
                i["outputs"] != layout_info(file_layout)["outputs"]:
            continue
        streams = framing.streams if framing is not None else False
        if variant != "recurrent" and i["streams"] != streams:
            continue
        prefixed = framing is not None and framing.prefixed
        if prefixed and not i["prefix"]:
            continue
        if framing is not None and framing.cell_ext and i["cell_ext"] != framing.cell_ext:
            continue
        out.append(name)
    return out


def _check_variant(variant: str, desc: Mapping[str, Any]) -> None:
    """Refuse a cache state that cannot be of the variant asked for: a recurrent cache never
    stores V transposed (its reader refuses it), and every cell of a unified cache's state names
    at least one sequence (only a recurrent single-sequence state has cells without one)."""
    if variant == "recurrent" and desc["v_trans"]:
        raise StateError("not a recurrent cache state: it stores V transposed, which a recurrent cache never does")
    if variant != "recurrent" and desc["cell_count"] and desc["n_seq_id_min"] == 0:
        name = "an iSWA" if variant == "iswa" else "a unified"
        raise StateError(f"not {name} cache state: it has cells without a sequence id, as only a recurrent "
                         "cache's state has")


def _blob_kind(sections: list) -> str:
    """A bare cache state: one sequence's or the whole cache's (a single-sequence unified state
    lists one id per cell, a recurrent one none)."""
    if sections[-1].get("layer_records"):
        # a hybrid memory's: the recurrent part of a sequence's state lists no id
        rec = sections[-1]
        if rec["cell_count"]:
            return "sequence blob" if rec["n_seq_id"][1] == 0 else "whole-cache blob"
        sections = sections[:-1] or sections
    s = sections[0]
    ids = set(s["sequences"])
    if all(x["n_seq_id"][1] <= 1 for x in sections) and len(ids) <= 1 and \
            all(x["n_seq_id"][0] == x["n_seq_id"][1] for x in sections if x["cell_count"]):
        return "sequence blob"
    return "whole-cache blob"


def _reach(e: StateError) -> int:
    """The byte of the file past which a failed read could not go (-1 when it does not say)."""
    at = re.search(r"(?:truncated at|after) byte (\d+)", str(e))
    return -1 if at is None else int(at.group(1)) + getattr(e, "base", 0)


def _furthest(m: memoryview, kind: str, variant: str | None, layout: str | None, e: StateError) -> CacheStateError:
    """Why a session or sequence file does not read: without a layout, the failure of the layout
    that reads furthest into it (a truncated file breaks off in every layout; the one of its
    shape breaks off last, where the bytes end)."""
    best = CacheStateError(str(e), kind, 0)
    if layout is None:
        from kvcache._core import LAYOUTS

        for name in LAYOUTS:
            try:
                report_bytes(m, variant, layout=name)
            except StateError as x:
                if _reach(x) > _reach(best):
                    best = x if isinstance(x, CacheStateError) else CacheStateError(str(x), kind, 0)
    return best


def report_bytes(data, variant: str | None = None, name: str | None = None, layout: str | None = None) -> dict:
    """The report on a state held in data (bytes-like). Raises kvcache.StateError when it cannot be
    read. variant: "unified", "iswa", "recurrent" or None to guess; layout: a name of
    kvcache.LAYOUTS or None to find it (the report's ``layout`` names what was found, and
    ``layouts`` every layout whose writers produce such bytes)."""
    from kvcache import statefile
    from kvcache._core import describe_state

    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    m = memoryview(data).cast("B")
    if bytes(m[:4]) == GGUF_MAGIC:
        raise StateError("this is a GGUF model, not a state file: use `kvcache plan` for the cache it needs")
    kind = statefile.detect(m)
    out: dict[str, Any] = {"file": name, "size": len(m), "kind": KINDS[kind]}
    arch = None
    file_layout = layout
    version = None
    if kind in ("session", "sequence"):
        parse = statefile.parse_session_file if kind == "session" else statefile.parse_sequence_file
        try:
            f = parse(m, layout=layout)
        except StateError as e:
            raise _furthest(m, kind, variant, layout, e) from None
        file_layout, version = f.layout, f.version
        out["header"] = {"magic": f"0x{f.magic:08x}", "version": f.version}
        out["tokens"] = {"count": len(f.tokens), "values": f.tokens.tolist()}
        if isinstance(f, statefile.SessionFile):   # the state is its context state's cache part
            ctx = f.context
            part, base = ctx.cache, ctx.cache_offset
        else:
            ctx = None
            part, base = f.cache, f.cache_offset
    elif kind == "context":
        try:
            ctx = statefile.parse_context_state(m, layout=layout)
            part, base = ctx.cache, ctx.cache_offset
            file_layout = ctx.layout
        except StateError as e:
            # a bare cache state can begin like a context state; it is one if it reads as one
            if not statefile.memory_framings(m):
                try:
                    describe_state(m)
                except StateError:
                    raise e from None
            kind, ctx, part, base = "cache", None, m, 0
            out["kind"] = KINDS[kind]
    else:
        ctx = None
        part, base = m, 0
    if ctx is not None:
        arch = ctx.arch
        out["context"] = {"arch": ctx.arch, "has_outputs": ctx.has_outputs, "n_outputs": ctx.n_outputs, "output_pos": ctx.output_pos.tolist(),
                          "logits": len(ctx.logits), "n_vocab": ctx.n_vocab, "embeddings": len(ctx.embeddings)}
    from kvcache._core import layout_info

    streams = None if file_layout is None else layout_info(file_layout)["streams"]
    try:
        variant, guessed, sections, trailing, framing = _cache_sections(part, base, variant, arch, streams,
                                                                        kind == "cache")
    except StateError as e:
        if kind == "cache" and bytes(m[:4]) == SEQ_MAGIC_BYTES:
            raise CacheStateError(f"a {KINDS['blob']} (it starts with its prefix magic) that does not read as one: "
                                  f"{e}", "blob", base) from None
        if kind == "cache" and variant is None:
            raise CacheStateError(NOT_A_STATE, kind, base) from None
        raise CacheStateError(str(e), kind, base) from e
    if trailing:
        raise StateError(f"{trailing} trailing bytes after the cache state (it ends at byte "
                         f"{len(m) - trailing} of {len(m)})")
    if kind == "cache":
        out["kind"] = _blob_kind(sections)
    out["variant"] = variant
    out["variant_guessed"] = guessed
    found = _layouts_of(kind, variant, framing, file_layout, version)
    if layout is not None and layout not in found:
        raise StateError(f"not a state of layout {layout}: it reads as {', '.join(found) or 'no layout'}")
    out["layout"] = layout or (file_layout if file_layout in found else found[0] if found else None)
    out["layouts"] = found
    if framing is not None:
        out["framing"] = {"stream_counts": framing.streams, "prefix": framing.prefixed,
                          "src_seq_id": framing.src_seq_id, "n_stream": [len(p) for p in framing.parts]}
        if framing.cell_ext:
            out["framing"]["cell_ext"] = framing.cell_ext
    out["cell_count"] = sum(s["cell_count"] for s in sections)
    out["sections"] = sections
    if variant == "hybrid":
        attn = [s for s in sections if not s.get("layer_records")]
        rec = sections[-1]
        out["parts"] = {
            "attention": None if not attn else {"cells": sum(s["cell_count"] for s in attn),
                                                "layers": max(s["n_layer"] for s in attn)},
            "recurrent": {"cells": rec["cell_count"], "layers": rec["n_layer"], "layer_records": rec["layer_records"]}}
    # the bytes of the cache part outside its sections: the prefix, the stream counts
    framed = 0
    if framing is not None:
        n_counted = len(framing.parts) - (1 if framing.recurrent_records else 0)
        framed = (8 if framing.prefixed else 0) + (4 * n_counted if framing.streams else 0)
    out["bytes"] = {"wrapper": base, "cache": len(m) - base - framed, "framing": framed}
    return out


def report(path, variant: str | None = None, layout: str | None = None) -> dict:
    """The report on the state file at path (see :func:`report_bytes`)."""
    from kvcache._atomic import read_regular

    data = read_regular(path)
    return report_bytes(data, variant, name=str(path), layout=layout)


def layout_text(names: list[str]) -> str:
    """Layout names and the llama-cpp-python releases that write them, as one phrase."""
    from kvcache._core import layout_info

    if not names:
        return "no known layout"
    rel = [layout_info(n)["llama_cpp_python"] for n in reversed(names)]
    first, last = rel[0].split("-")[0], rel[-1].split("-")[-1]
    span = names[0] if len(names) == 1 else f"{names[-1]} to {names[0]}"
    return f"{span} (llama-cpp-python {first}{'' if first == last else '-' + last})"


def format_report(r: dict) -> str:
    """The report as text, one fact per line."""
    b = r["bytes"]
    framing = f" + {b['framing']} framing" if b["framing"] else ""
    lines = [f"{r['file'] or '<data>'}: {r['kind']}, {r['size']} bytes "
             f"({b['wrapper']} wrapper{framing} + {b['cache']} cache state)"]
    if "header" in r:
        h = r["header"]
        lines.append(f"  magic {h['magic']}, version {h['version']}")
    if "tokens" in r:
        t = r["tokens"]
        head = " ".join(str(x) for x in t["values"][:16]) + (" ..." if t["count"] > 16 else "")
        lines.append(f"  tokens: {t['count']}" + (f": {head}" if t["count"] else ""))
    if "context" in r:
        c = r["context"]
        if not c.get("has_outputs", True):
            lines.append(f"  arch {c['arch']} (no outputs, logits or embeddings in this layout)")
        else:
            lines.append(f"  arch {c['arch']}, {c['n_outputs']} outputs at batch positions {c['output_pos']}, "
                         f"{c['logits']} logits" + (f" ({c['n_vocab']} per output)" if c["n_vocab"] else "")
                         + f", {c['embeddings']} embeddings")
    lines.append(f"  layout {layout_text(r['layouts'])}")
    if "framing" in r and r["framing"]["prefix"]:
        lines.append(f"  sequence-blob prefix, 8 bytes: magic 0x{int.from_bytes(SEQ_MAGIC_BYTES, 'little'):08x}, "
                     f"source seq {r['framing']['src_seq_id']}")
    if "framing" in r and r["framing"].get("cell_ext"):
        what = "x, y, token id" if r["framing"]["cell_ext"] == 12 else "x, y"
        lines.append(f"  per-cell extension: {r['framing']['cell_ext']} bytes per cell ({what})")
    lines.append(f"  cache: {r['variant']}{' (guessed)' if r['variant_guessed'] else ''}, "
                 f"{plural(r['cell_count'], 'cell')}")
    if "parts" in r:
        a, rc = r["parts"]["attention"], r["parts"]["recurrent"]
        lines.append("  attention part: " + ("none (the recurrent part alone)" if a is None else
                                             f"{plural(a['cells'], 'cell')}, {plural(a['layers'], 'layer')}"))
        lines.append(f"  recurrent part: {plural(rc['cells'], 'cell')}, {plural(rc['layers'], 'layer')} counted, "
                     f"records for {rc['layer_records']} (the recurrent layers)")
    for s in r["sections"]:
        if not s["n_layer"] and not s["cell_count"] and s["size"] == 4:
            lines.append(f"  [{s['name']}] at byte {s['offset']}, 4 bytes: empty (its cell count alone)")
            continue
        counted = f" ({s['layer_records']} with records)" if s.get("layer_records") else ""
        lines.append(f"  [{s['name']}] at byte {s['offset']}, {plural(s['size'], 'byte')}: "
                     f"{plural(s['cell_count'], 'cell')}, {plural(s['n_layer'], 'layer')}{counted}, "
                     f"V {'transposed' if s['v_trans'] else 'rows'}")
        for seq, rg in s["sequences"].items():
            text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in rg)
            single = len(rg) == 1 and rg[0][0] == rg[0][1]
            who = "(its id is not stored)" if seq == "unnamed" else seq
            lines.append(f"    seq {who}: position{'' if single else 's'} {text}")
        for l in s["layers"]:
            v = (f"{l['v_type']} transposed, {l['v_width']} x {l['v_elem_size']}-byte elements"
                 if s["v_trans"] else f"{l['v_type']} rows of {l['v_row_size']} bytes")
            lines.append(f"    layer {l['index']}: K {l['k_type']} rows of {l['k_row_size']} bytes "
                         f"({l['k_bytes']}), V {v} ({l['v_bytes']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``kvcache inspect`` as a program (``python -m kvcache.inspect FILE``): the command line's
    ``inspect`` command (kvcache.cli.inspect)."""
    from kvcache.cli import main as cli_main

    return cli_main(["inspect", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
