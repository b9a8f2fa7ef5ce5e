"""The hybrid memory of models that mix attention and recurrent layers: today's llama.cpp's
``llama_memory_hybrid`` (Granite 4, LFM2, Jamba, Falcon-H1, Nemotron-H, Qwen3-Next, PLaMo 2), and
``llama_memory_hybrid_iswa`` when the attention layers have a sliding window (LFM2 with
``attention.sliding_window``).

:class:`HybridCache` keeps the attention layers' K/V in a ``UnifiedCache(semantics="2026")`` and
the recurrent layers' states in a ``RecurrentCache(semantics="2026")``, and drives them as
llama.cpp does: a ubatch is placed in both or neither (the recurrent part first), a ``seq_rm``
the recurrent part refuses changes neither, a sequence's position range is the intersection of
the parts', the K-shift touches the attention part only."""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Iterator, Sequence, cast

from kvcache._core import StateError, UBatch, _Hybrid, _ISWA2026, _seq_export, _seq_import_begin, ggml_row_size
from kvcache._store_format import _header_cells
from kvcache.handoff import HybridExport, HybridImport, PartsImport, SeqImport, split_hybrid, split_parts
from kvcache.iswa import ISWACache2026

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["HybridCache", "split_batch"]


class HybridCache(_Hybrid):
    """Today's hybrid memory: a unified KV cache for the attention layers and a recurrent memory
    for the recurrent ones.

    ``HybridCache(kv_size, n_layer, recurrent_layers, n_embd_k_gqa, n_embd_v_gqa, n_embd_r,
    n_embd_s=0, n_seq_max=1, type_k="f16", type_v="f16", v_trans=True, n_rs_seq=0,
    attn_layers=None, kv_unified=True, n_embd_head_k=None, rope=None, buffers="owned", n_swa=0,
    swa_type="standard", swa_layers=None, n_batch=512, swa_full=None)``

    - ``kv_size``: cells of the attention part (llama.cpp's ``n_ctx_seq``; no padding).
    - ``n_layer``: the model's layers; ``recurrent_layers``: those with a recurrent state
      (indices or a predicate ``il -> bool``); ``attn_layers``: those with K/V (default: the
      others; Falcon-H1 has both in every layer, Nemotron-H's feed-forward layers neither).
    - ``n_embd_k_gqa`` / ``n_embd_v_gqa``: the attention layers' K / V widths (an int or one per
      model layer); ``n_embd_r`` / ``n_embd_s``: the recurrent layers' R (rolling, convolution)
      and S (state) widths, f32 as llama.cpp keeps them. The recurrent part has a cell per
      sequence (``max(1, n_seq_max)``).
    - ``n_rs_seq``: rollback snapshots per state (docs/semantics.md, rule C9).
    - ``n_swa`` > 0: the attention layers have a sliding window (``llama_memory_hybrid_iswa``):
      the attention part is an :class:`kvcache.ISWACache2026` (``swa_layers``, default every
      attention layer as LFM2's loader marks them; ``swa_type``; ``n_batch``, the ubatch its SWA
      cache is sized for; ``swa_full``, None for today's default True:
      ``kvcache._core.swa_full_arg``), whose two masks
      ``kq_mask`` gives; a state holds its base and SWA caches' states; prefix reuse needs both
      caches of the pair to serve a hit (ISWACache2026's rule) besides a checkpoint.
    - ``buffers``: "owned", None / "none" (metadata only) for both parts, or a pair
      ``({layer: (K, V)}, {layer: (R, S)})`` of borrowed memory by model layer (the recurrent
      rows ``kv_size * (1 + n_rs_seq)`` each).

    ``attn`` and ``recr`` are the parts; ``store`` writes an attention layer's K/V,
    ``store_state`` a recurrent layer's states, ``kq_mask`` is the attention layers' mask and
    ``s_copy`` / ``rs_z`` the recurrent layers' inputs."""

    __slots__ = ()

    @property
    def can_shift(self) -> bool:
        """What ``llama_memory_can_shift`` reports for this memory: the attention part's answer
        (an iSWA pair's: its two caches of one size; a unified cache's: true), recurrent states
        having nothing to shift. llama.cpp aborts a decode with a pending K-shift where it is
        false; update() here shifts each cache's own cells as ISWACache2026.update does."""
        attn = self.attn
        return bool(cast(ISWACache2026, attn).can_shift) if isinstance(attn, _ISWA2026) else True

    def ubatches(self, pos: Sequence[int], seq_id: Sequence[int], n_ubatch: int,
                 embd_all: bool = False) -> Iterator[UBatch]:
        """The ubatches llama.cpp's hybrid memory cuts a batch into (:func:`split_batch`): equal
        splits, of consecutive sequence ids when the attention part has a stream per sequence,
        keeping each sequence's last ``n_rs_seq + 1`` tokens together; by sequence when every
        token is an output (``embd_all``)."""
        return split_batch(pos, seq_id, n_ubatch, embd_all=embd_all, sequential=self.attn.n_stream > 1,
                           n_keep_tail=self.n_rs_seq + 1 if self.n_rs_seq else 0)

    def seq_export(self, seq_id: int) -> HybridExport:
        """Sequence seq_id ready for a transfer: the attention part's export (UnifiedCache.seq_export,
        ISWACache.seq_export with a window: its regions), then the recurrent part's state of the
        sequence, its R/S rows as regions of the recurrent part's memory and the rest in the
        header. See docs/disaggregated.md."""
        with self._op:      # both parts of one moment: a change from this thread's finalizers is refused
            attn = self.attn
            part = cast(ISWACache2026, attn).seq_export(seq_id) if isinstance(attn, _ISWA2026) else \
                _seq_export(attn, seq_id)
            return HybridExport(part, *self.recr._seq_handoff(seq_id))

    def seq_import_begin(self, header: Buffer, seq_id: int | None = None) -> HybridImport:
        """Begin receiving the sequence a HybridExport header describes into seq_id (None: the
        exporter's): the recurrent state (its rows zeros) is checked against a scratch memory of
        the recurrent part's geometry, then the attention part's import begins
        (UnifiedCache.seq_import_begin); StateError, nothing begun and nothing changed, when either
        refuses. Until commit() or abort() the HybridCache and its parts refuse changes."""
        fields = split_hybrid(header)
        # the rows' lengths come from the header: no more than one cell's R and S rows of this
        # geometry (before any memory is taken for them)
        r = self.recr
        cell_bytes = sum(ggml_row_size(r.type_k, w) for w in r.n_embd_k) + \
            sum(ggml_row_size(r.type_v, w) for w in r.n_embd_v)
        if fields.n_row_bytes > cell_bytes:
            raise StateError(f"seq_import_begin: the header's recurrent rows hold {fields.n_row_bytes} bytes, a "
                             f"cell of this cache's recurrent part {cell_bytes}")
        # the recurrent state read by a memory of the recurrent part's geometry (without K/V)
        r_width = dict(zip(self.recurrent_layers, self.recr.n_embd_k))
        s_width = dict(zip(self.recurrent_layers, self.recr.n_embd_v))
        scratch = HybridCache(1, self.n_layer, self.recurrent_layers, 1, 1,
                              [r_width.get(il, 0) for il in range(self.n_layer)],
                              [s_width.get(il, 0) for il in range(self.n_layer)], n_seq_max=self.n_seq_max,
                              n_rs_seq=self.n_rs_seq, attn_layers=self.attn_layers, buffers="none")
        try:
            scratch.state_read(fields.state(None), 0, exact=True, partial_only=True)
        except StateError as e:
            raise StateError(f"seq_import_begin: the recurrent state: {e}") from None
        attn = self.attn
        attn_header = split_parts(fields.attn, 2)[0] if isinstance(attn, _ISWA2026) else fields.attn
        # the recurrent state must stand where the attention part's cells end, as an export has it:
        # asked before the attention part's import begins (its search for room may evict held
        # prefixes), of a header that can be read (a malformed one the attention part refuses)
        at = scratch.recr.seq_pos_max(0)
        ends = _cells_end(attn_header)
        _check_state_at(at, ends)
        part: SeqImport | PartsImport
        if isinstance(attn, _ISWA2026):
            part = cast(ISWACache2026, attn).seq_import_begin(fields.attn, seq_id)
        else:
            part = _seq_import_begin(attn, fields.attn, seq_id)
        if ends is None:    # (a header the attention part takes is one this reads)
            part.abort()
            raise StateError("seq_import_begin: the attention part's header lists no cells that can be read")
        return HybridImport(part, self.recr, fields, self._hold)


def _cells_end(header: bytes) -> int | None:
    """The largest position of a hand-off header's cells (-1: none), None when the header cannot be read."""
    try:
        return int(_header_cells(header)[0].max(initial=-1))
    except (struct.error, ValueError):
        return None


def _check_state_at(at: int, end: int | None) -> None:
    if end is not None and end >= 0 and end != at:
        raise StateError(f"seq_import_begin: the recurrent state is at position {at}, the attention part's cells "
                         f"end at {end}")


def split_batch(pos: Sequence[int], seq_id: Sequence[int], n_ubatch: int, *, embd_all: bool = False,
                sequential: bool = False, n_keep_tail: int = 0) -> Iterator[UBatch]:
    """Cut a batch (one sequence id per token) into ubatches as today's llama.cpp's batch
    allocator does for a recurrent or hybrid memory: ``split_seq`` when ``embd_all`` (a run of
    one sequence's tokens), else ``split_equal``: the first unused token of each sequence (of
    consecutive ids from the first with ``sequential``) opens a group, every group takes a
    token in turn while all have one left and the ubatch has room, and with ``n_keep_tail`` a
    group that would leave fewer than that many of its tokens for later is deferred (or, alone,
    cut so that it leaves that many, or taken whole when it fits). Each ubatch is a
    :class:`UBatch` of groups of equal length, in group order."""
    n = len(pos)
    if len(seq_id) != n:
        raise ValueError(f"seq_id has {len(seq_id)} entries, pos {n}")
    if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, int) or n_ubatch < 1:
        raise ValueError(f"n_ubatch = {n_ubatch!r}: expected a positive int")
    if n_keep_tail and not embd_all and n_ubatch <= n_keep_tail:
        raise ValueError(f"n_ubatch = {n_ubatch} must exceed the tokens kept together (n_rs_seq + 1 = {n_keep_tail})")
    ids = [int(s) for s in seq_id]
    used = [False] * n
    tokens_of: dict[int, list[int]] = {}
    for i, s in enumerate(ids):
        tokens_of.setdefault(s, []).append(i)
    while not all(used):
        groups = [_split_seq(ids, used, n_ubatch)] if embd_all else _split_equal(ids, used, tokens_of, n_ubatch,
                                                                                  sequential, n_keep_tail)
        if not groups or not groups[0]:
            return
        k = len(groups[0])
        flat = [i for g in groups for i in g]
        yield UBatch([int(pos[i]) for i in flat], [ids[g[0]] for g in groups], n_seq_tokens=k)


def _split_seq(ids: list[int], used: list[bool], n_ubatch: int) -> list[int]:
    first = used.index(False)
    out = []
    for i in range(first, len(ids)):
        if not used[i] and ids[i] == ids[first]:
            out.append(i)
            used[i] = True
            if len(out) >= n_ubatch:
                break
    return out


def _split_equal(ids: list[int], used: list[bool], tokens_of: dict[int, list[int]], n_ubatch: int,
                 sequential: bool, n_keep_tail: int) -> list[list[int]]:
    seqs: list[int] = []
    last = -1
    for i, s in enumerate(ids):
        if used[i] or s in seqs:
            continue
        if sequential and seqs and s != last + 1:
            continue
        seqs.append(s)
        last = s
        if len(seqs) > n_ubatch:
            break
    if not seqs:
        return []
    cur = {s: 0 for s in seqs}
    for s in seqs:
        while used[tokens_of[s][cur[s]]]:
            cur[s] += 1
    groups: list[list[int]] = [[] for _ in seqs]
    while all(cur[s] < len(tokens_of[s]) for s in seqs):
        for g, s in enumerate(seqs):
            i = tokens_of[s][cur[s]]
            groups[g].append(i)
            used[i] = True
            cur[s] += 1
        if (len(groups[0]) + 1) * len(seqs) > n_ubatch:
            break
    if n_keep_tail:
        def left(g: int) -> int:
            return len(tokens_of[seqs[g]]) - cur[seqs[g]]
        keep = 0
        while keep < len(seqs) and not (0 != left(keep) < n_keep_tail):
            keep += 1
        if keep == 0:
            s = seqs[0]
            if len(groups[0]) + left(0) <= n_ubatch:
                while left(0) > 0:          # the sequence to its end
                    i = tokens_of[s][cur[s]]
                    groups[0].append(i)
                    used[i] = True
                    cur[s] += 1
            else:
                while left(0) < n_keep_tail:    # leave n_keep_tail tokens for later
                    used[groups[0].pop()] = False
                    cur[s] -= 1
            keep = 1
        for g in range(keep, len(seqs)):    # the deferred sequences' tokens go back
            for i in groups[g]:
                used[i] = False
        groups = groups[:keep]
    return groups
