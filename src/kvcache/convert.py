"""Rewriting a state file in another layout, without a cache: the layouts differ in their framing
only (docs/format.md). Built on :mod:`kvcache.inspect`'s report of what the bytes hold, which is
built on :mod:`kvcache.statefile`'s parsers; neither imports this module."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvcache._core import DEFAULT_LAYOUT, MAX_SEQ, SEQ_MAGIC, StateError, int_arg, layout_info
from kvcache.inspect import report_bytes
from kvcache.statefile import (_NO_F32, _NO_I32, SEQUENCE_MAGIC, SESSION_MAGIC, _check_layout, _context_header,
                               _view, parse_context_state, parse_session_file)

__all__ = ["Converted", "convert"]

@dataclass(frozen=True)
class Converted:
    """What :func:`convert` produced: ``data`` (the bytes in the target layout), ``kind`` (a key
    of kvcache.inspect.KINDS, or "sequence blob" / "whole-cache blob"), ``source`` (the layout
    the input was read in) and ``notes``: what the target layout could not hold or had to leave
    out, one sentence each."""

    data: bytes = field(repr=False)
    kind: str
    source: str
    layout: str
    notes: tuple[str, ...]


def _trim_swa(body: bytes, sec: dict[str, Any], n_swa: int, swa_type: Literal["standard", "chunked"]) -> bytes | None:
    """One stream section of a sequence's SWA cache state (layout 2025's body: cell count, cells,
    K/V) without the cells outside the window of the sequence's last position, or None when
    this section's geometry is not one a cache takes. A one-stream cache of semantics "2026"
    with the section's geometry and the window reads it and writes it back in a layout that
    trims: the codec's own rule, not a second one."""
    from kvcache._core import ggml_type
    from kvcache.unified import UnifiedCache

    layers = sec["layers"]
    ids = [k for k in sec["sequences"] if k != "unnamed"]
    if not layers or len(ids) != 1 or len({(x["k_type_id"], x["v_type_id"]) for x in layers}) != 1:
        return None
    sid = int(ids[0])
    tk, tv = ggml_type(layers[0]["k_type_id"]), ggml_type(layers[0]["v_type_id"])

    def width(row: int, t: Any) -> int:
        return int(row // t.type_size * t.blck_size)

    wk = [width(x["k_row_size"], tk) for x in layers]
    wv = [x["v_width"] if sec["v_trans"] else width(x["v_row_size"], tv) for x in layers]
    try:
        c = UnifiedCache(sec["cell_count"], len(layers), wk, wv, type_k=tk.name, type_v=tv.name,
                         v_trans=sec["v_trans"], n_seq_max=sid + 1, n_pad=1, n_swa=n_swa, swa_type=swa_type,
                         semantics="2026")
        c.state_read(struct.pack("<I", 1) + body, sid, layout="2025-08", exact=True)
        return c.state_write(sid, layout="2026-06", prefix=False)[4:]   # without its stream count
    except (StateError, ValueError):
        return None


def _reext(body: bytes, src: int, dst: int) -> bytes:
    """A stream section's body with each cell's extension of src bytes rewritten as dst bytes
    (12 -> 8 drops the token id, 8 -> 12 gives it -1, llama.cpp's none)."""
    cc = struct.unpack_from("<I", body)[0]
    out = [body[:4]]
    off = 4
    for _ in range(cc):
        n = struct.unpack_from("<I", body, off + 4)[0]
        out.append(body[off:off + 16])                                  # pos, n_seq_id, x, y
        if dst == 12:
            out.append(body[off + 16:off + 20] if src == 12 else struct.pack("<i", -1))
        off += 8 + src
        out.append(body[off:off + 4 * n])
        off += 4 * n
    out.append(body[off:])
    return b"".join(out)


def _memory(r: dict[str, Any], data: memoryview, to: str, seq_id: int | None, notes: list[str],
            single: bool | None = None, window: tuple[int, Literal["standard", "chunked"]] | None = None,
            default_seq_id: int | None = None) -> bytes:
    """The memory state of an inspect report's sections, framed for layout to. single: the
    state is one sequence's (a sequence file's); None: the report's kind says so, and a bare
    blob is surely a sequence's when it has the prefix or seq_id or default_seq_id is given (a
    whole state of one sequence has the same bytes). window: (n_swa, swa_type) of an iSWA cache,
    to leave out the SWA cells outside it of a sequence's state when layout to does and the
    input's did not. default_seq_id: the id of a prefix the input does not give."""
    info = layout_info(to)
    sure = single is not None or bool((r.get("framing") or {}).get("prefix")) or seq_id is not None or \
        default_seq_id is not None
    single = r["kind"] == "sequence blob" if single is None else single
    src_trims = r["layout"] is not None and layout_info(r["layout"])["swa_trim"]
    trim = r["variant"] == "iswa" and single and info["swa_trim"] and not src_trims
    left_out = kept = 0
    variant = r["variant"]
    parts: dict[str, list[dict[str, Any]]] = {}
    for s in r["sections"]:
        parts.setdefault(s["name"].split(" ")[0], []).append(s)
    out = []
    src_ext, dst_ext = (r.get("framing") or {}).get("cell_ext", 0), info["cell_ext"]
    if src_ext and not dst_ext:
        raise StateError(f"the cells carry the per-cell extension ({src_ext} bytes each), which layout {to} has no "
                         "room for")
    if src_ext and src_ext != dst_ext:
        notes.append(f"the per-cell extension rewritten from {src_ext} to {dst_ext} bytes"
                     + (" (the token ids dropped)" if dst_ext < src_ext else " (token ids -1: the input has none)"))
    if r["kind"] == "sequence blob":
        fr = r.get("framing") or {}
        sid = seq_id if seq_id is not None else fr.get("src_seq_id")
        if info["prefix"]:
            if sid is None and default_seq_id is not None:
                sid = default_seq_id
                notes.append(f"the sequence-blob prefix of layout {to} names seq {sid}: the input does not say which "
                             "sequence it is (llama.cpp reads the id and does not use it)")
            if sid is None:
                notes.append(f"written without the sequence-blob prefix of layout {to}: the input does not say "
                             "which sequence it is (pass seq_id)")
            else:
                out.append(struct.pack("<Ii", SEQ_MAGIC, sid))
        elif fr.get("prefix"):
            notes.append(f"the sequence-blob prefix (source seq {fr.get('src_seq_id')}) left out: layout {to} has none")
    for name, secs in parts.items():
        bodies = [bytes(data[s["offset"]:s["offset"] + s["size"]]) for s in secs]
        if src_ext and src_ext != dst_ext:
            bodies = [_reext(b, src_ext, dst_ext) if s["cell_count"] else b for b, s in zip(bodies, secs)]
        empty = [s["n_layer"] == 0 and s["cell_count"] == 0 and s["size"] == 4 for s in secs]
        if trim and window is not None and sure and name == "swa":
            for k, sec in enumerate(secs):
                if not sec["cell_count"]:
                    continue
                new = _trim_swa(bodies[k], sec, *window)
                if new is None:
                    kept += sec["cell_count"]
                    continue
                # the sequence's last cell is always in its window: the section stays non-empty
                left_out += sec["cell_count"] - struct.unpack_from("<I", new)[0]
                bodies[k] = new
        if variant == "recurrent" or not info["streams"]:
            if len(secs) != 1:
                raise StateError(f"the {name} cache state has {len(secs)} streams; layout {to} has one stream")
            if empty[0]:
                raise StateError(f"the {name} cache state's one stream is empty, written as its cell count alone: "
                                 f"layout {to} writes an empty state with its layer headers, which the input does "
                                 "not hold (write it from a cache of the model instead)")
            out.append(bodies[0])
        else:
            out.append(struct.pack("<I", len(secs)))
            out.extend(b"\0\0\0\0" if e or s["cell_count"] == 0 else b for b, s, e in zip(bodies, secs, empty))
    if trim:
        if window is None or not sure:
            how = ("give the window, n_swa and swa_type, to leave them out" if window is None else
                   "the bytes may be a whole state of one sequence: pass seq_id to treat them as a sequence's")
            notes.append(f"the SWA cache's cells outside the window were kept (layout {to}'s llama.cpp leaves them "
                         f"out of a sequence state; it reads them all the same; {how})")
        else:
            notes.append(f"left out {left_out} of the SWA cache's cells: outside the window (n_swa {window[0]}, "
                         f"{window[1]}) of the sequence's last position, as layout {to}'s llama.cpp leaves them out")
            if kept:
                notes.append(f"kept {kept} SWA cells of a section whose geometry no cache takes (mixed K/V types)")
    elif variant == "iswa" and single and src_trims and not info["swa_trim"]:
        notes.append("the SWA cache holds only the cells within the window: the input's layout had left the "
                     "others out")
    return b"".join(out)


def convert(data: Any, to: str = DEFAULT_LAYOUT, *, layout: str | None = None, variant: str | None = None,
            seq_id: int | None = None, n_swa: int | None = None,
            swa_type: Literal["standard", "chunked"] = "standard", default_seq_id: int | None = None) -> Converted:
    """Rewrite a state file (sequence blob, whole-cache blob, whole-context state, session file,
    sequence file) in layout ``to``, without a cache: the layouts differ in their framing only.

    layout: the input's layout (None: found from the bytes); variant: "unified", "iswa",
    "recurrent" or "hybrid" (None: found; refused when the bytes do not tell and the framing
    changes; a hybrid memory's state exists in "2026" only: StateError for another ``to``);
    seq_id: the sequence of a bare sequence state, for the prefix of the layouts that have one
    (default: the input's prefix; else default_seq_id, noted; else, None, no prefix is written
    and the notes say so: the bytes may be a whole state of one sequence). What the target
    cannot hold is left out and said in ``notes``: the outputs of a whole-context state (to a
    layout without them), the prefix (to a layout without it), and, given the window of an iSWA
    model (``n_swa`` > 0 and ``swa_type`` "standard" or "chunked"; the state does not hold it),
    the SWA cache's cells outside the window of a sequence's state (a sequence blob or a
    sequence file) converted to a layout that leaves them out ("2026-06" and later) from one
    that kept them; without the window they are kept, and the notes say so. Raises StateError
    when the input does not read, or ValueError for an unknown layout or window, or a seq_id
    outside [-1, MAX_SEQ)."""

    layout_info(to)
    _check_layout(layout)
    for name, sid in (("seq_id", seq_id), ("default_seq_id", default_seq_id)):
        if sid is not None:
            int_arg(sid, name, -1, MAX_SEQ - 1)   # -1: llama.cpp's every sequence
    window = None
    if n_swa is not None:
        if swa_type not in ("standard", "chunked"):
            raise ValueError(f"swa_type = {swa_type!r}: expected 'standard' or 'chunked'")
        window = (int_arg(n_swa, "n_swa", 1, 2**31 - 1), swa_type)
    m = _view(data)
    r = report_bytes(m, variant, layout=layout)
    if r["variant"] == "hybrid":
        # llama.cpp writes a hybrid memory's state in today's layout only: nothing to reframe
        if to != DEFAULT_LAYOUT:
            raise StateError(f"a hybrid memory's state exists in layout {DEFAULT_LAYOUT} only (llama-cpp-python "
                             f"0.3.36): it cannot be converted to layout {to}")
        framing = r.get("framing") or {}
        if seq_id is not None and framing.get("prefix"):
            # the prefix names the sequence: the id given replaces it, the state is unchanged
            renamed = struct.pack("<Ii", SEQ_MAGIC, seq_id) + bytes(m[8:])
            return Converted(renamed, r["kind"], DEFAULT_LAYOUT, to,
                             (f"a hybrid memory's state, already in layout {DEFAULT_LAYOUT}: its sequence-blob prefix "
                              f"names seq {seq_id} (was {framing.get('src_seq_id')}), the state unchanged",))
        said = [f"a hybrid memory's state, already in layout {DEFAULT_LAYOUT}: written unchanged"]
        if seq_id is not None:
            said.append("seq_id not used: the state has no sequence-blob prefix to name it")
        return Converted(bytes(m), r["kind"], DEFAULT_LAYOUT, to, tuple(said))
    if r["variant_guessed"] and r["kind"] in ("sequence blob", "whole-cache blob") and r["variant"] != "iswa":
        # unified and recurrent states are framed differently from "2025-08" on; the bytes tell
        # them apart by stream counts, a prefix before a state without them, or a sequence's
        # cells (a unified state lists the id, a recurrent one none)
        fr = r.get("framing")
        told = fr is not None and (fr["stream_counts"] or fr["prefix"])
        cells = [s for s in r["sections"] if s["cell_count"]]
        told = told or (r["kind"] == "sequence blob" and bool(cells))
        told = told or any(s["n_seq_id"][1] == 0 for s in cells)
        if not told and layout_info(to)["streams"]:
            raise StateError("the bytes do not say whether this is a unified or a recurrent cache's state, and "
                             f"layout {to} frames the two differently: pass variant")
    source = r["layout"] or (r["layouts"][0] if r["layouts"] else "2025")
    notes: list[str] = []
    kind = r["kind"]
    if kind in ("sequence blob", "whole-cache blob"):
        return Converted(_memory(r, m, to, seq_id, notes, window=window, default_seq_id=default_seq_id), kind, source,
                         to, tuple(notes))
    info = layout_info(to)
    wrapper = r["bytes"]["wrapper"]
    out: list[bytes] = []
    if kind == "sequence file":
        toks = np.asarray(r["tokens"]["values"], dtype="<i4")
        out.append(struct.pack("<III", SEQUENCE_MAGIC, info["sequence_version"], len(toks)) + toks.tobytes())
        rr = dict(r, kind="whole-cache blob")
        out.append(_memory(rr, m, to, None, notes, single=True, window=window))
        return Converted(b"".join(out), kind, source, to, tuple(notes))
    # session file or whole-context state
    if kind == "session file":
        sf = parse_session_file(m, layout=layout)
        ctx = sf.context
        out.append(struct.pack("<III", SESSION_MAGIC, info["session_version"], len(sf.tokens)) + sf.tokens.tobytes())
    else:
        ctx = parse_context_state(m, layout=layout)
    if ctx.cache_offset != wrapper:
        raise StateError("the wrapper and its cache state disagree (internal error)")
    pos, lg, em = ctx.output_pos, ctx.logits, ctx.embeddings
    if not info["outputs"]:
        if len(pos) or len(lg) or len(em):
            notes.append(f"left out {len(pos)} outputs, {len(lg)} logits and {len(em)} embeddings: layout {to}'s "
                         "whole-context state has none")
        pos, lg, em = _NO_I32, _NO_F32, _NO_F32
    elif not ctx.has_outputs:
        notes.append(f"no outputs written (0 outputs, logits, embeddings): layout {ctx.layout} had none to give")
    out.append(_context_header(ctx.arch, pos, lg, em, to))
    rr = dict(r, kind="whole-cache blob")
    out.append(_memory(rr, m, to, None, notes))
    return Converted(b"".join(out), kind, source, to, tuple(notes))
