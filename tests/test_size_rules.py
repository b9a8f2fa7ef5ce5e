"""Size rules against literal values worked out by hand from llama.cpp, never from kvcache itself.

- the SWA cache of an iSWA pair. llama.cpp of mid-2025 (the iSWA constructor of the seed,
  llama-kv-cache.cpp): ``size_swa = min(size_base, GGML_PAD(n_swa*n_seq_max + n_ubatch, n_pad))``,
  ``size_base`` with swa_full. Today's llama.cpp: ``GGML_PAD(min(size_base, n_swa*(unified ?
  n_seq_max : 1) + n_ubatch), 256)`` per stream, whatever n_pad; ``size_base`` with swa_full;
- the cells of a context's cache (n_pad, kv_size, streams) in both semantics;
- the bytes of a K/V row per type: ggml's type table (elements per block, bytes per block):
  f32 1/4, f16 1/2, bf16 1/2, q8_0 32/34, q4_0 32/18, q4_1 32/20, q5_0 32/22, q5_1 32/24,
  iq4_nl 32/18.

Each table row changes one term against a neighbour, so that a rule that drops or misplaces a
term (n_seq_max, n_ubatch, the padding, the cap, swa_full, the stream split) fails somewhere."""
import pytest

import kvcache
from kvcache import plan

# (n_swa, n_seq_max, n_ubatch, n_pad, size_base, swa_full) -> cells of the SWA cache, mid-2025
SWA_2025 = [
    ((128, 1, 512, 32, 4096, False), 640),     # 128 + 512, already a multiple of 32
    ((128, 4, 512, 32, 4096, False), 1024),    # n_seq_max: 4 windows, 512 + 512
    ((128, 1, 1, 32, 4096, False), 160),       # n_ubatch: 129 padded to 160
    ((100, 3, 16, 32, 1024, False), 320),      # 316 padded to 32
    ((100, 3, 16, 256, 1024, False), 512),     # n_pad: 316 padded to 256
    ((100, 3, 16, 1, 1024, False), 316),       # n_pad 1: no padding
    ((8, 4, 7, 32, 1024, False), 64),          # 39 padded to 32
    ((1, 1, 1, 32, 256, False), 32),           # 2 padded to 32
    ((4096, 4, 512, 32, 4096, False), 4096),   # the cap: 16896 > size_base
    ((64, 3, 100, 256, 1024, False), 512),     # 292 padded to 256
    ((64, 3, 100, 256, 256, False), 256),      # the cap: padded to 512, then capped
    ((64, 3, 100, 256, 300, False), 300),      # the cap itself is not padded (the rule alone)
    ((256, 2, 512, 256, 1536, False), 1024),   # exactly 1024, no padding added
    ((1024, 2, 2048, 256, 8192, True), 8192),  # swa_full: size_base
    ((8, 2, 1, 32, 256, False), 32),           # 17 padded to 32
    ((8, 2, 1, 32, 256, True), 256),           # swa_full even where the rule gives 32
]

# (n_swa, n_seq_max, n_ubatch, n_pad, size_base, swa_full, kv_unified) -> cells per stream, today
SWA_2026 = [
    ((100, 3, 16, 1, 1024, False, True), 512),       # min(1024, 316) padded to 256
    ((100, 3, 16, 1, 1024, False, False), 256),      # a stream per sequence: 116 padded to 256
    ((128, 4, 512, 1, 4096, False, True), 1024),     # 1024, a multiple of 256
    ((128, 4, 512, 1, 4096, False, False), 768),     # 640 padded to 256
    ((128, 4, 512, 32, 4096, False, True), 1024),    # n_pad does not count
    ((300, 1, 212, 1, 8192, False, True), 512),      # 512 exactly
    ((300, 2, 212, 1, 8192, False, True), 1024),     # n_seq_max: 812 padded to 256
    ((300, 2, 212, 1, 8192, False, False), 512),     # not unified: one window
    ((300, 2, 213, 1, 8192, False, False), 768),     # n_ubatch: 513 padded to 256
    ((1, 1, 1, 1, 256, False, True), 256),           # 2 padded to 256
    ((4096, 4, 512, 1, 4096, False, True), 4096),    # the cap, then padded (already a multiple)
    ((4096, 4, 512, 1, 1000, False, True), 1024),    # capped at 1000 first, then padded past it
    ((100, 3, 16, 1, 1024, True, True), 1024),       # swa_full: size_base
    ((100, 3, 16, 1, 1024, True, False), 1024),      # swa_full, per stream
]


@pytest.mark.parametrize("args,cells", SWA_2025, ids=[str(a) for a, _ in SWA_2025])
def test_swa_size_2025(args, cells):
    n_swa, n_seq_max, n_ubatch, n_pad, size_base, swa_full = args
    assert plan.swa_size(size_base, n_swa, n_seq_max, n_ubatch, n_pad, swa_full, "2025") == cells
    if size_base % n_pad:
        return      # llama.cpp pads every context to n_pad cells: no such base cache to build
    c = kvcache.ISWACache(size_base, 2, 8, 8, swa_layers=[1], n_swa=n_swa, n_batch=n_ubatch, swa_full=swa_full,
                          n_seq_max=n_seq_max, n_pad=n_pad, buffers=None)
    assert (c.size_base, c.size_swa) == (size_base, cells)


@pytest.mark.parametrize("args,cells", SWA_2026, ids=[str(a) for a, _ in SWA_2026])
def test_swa_size_2026(args, cells):
    n_swa, n_seq_max, n_ubatch, n_pad, size_base, swa_full, unified = args
    assert plan.swa_size(size_base, n_swa, n_seq_max, n_ubatch, n_pad, swa_full, "2026", unified) == cells
    if size_base % 256:
        return      # today's llama.cpp pads every context to 256 cells: no such base cache to build
    c = kvcache.ISWACache(size_base, 2, 8, 8, swa_layers=[1], n_swa=n_swa, n_batch=n_ubatch, swa_full=swa_full,
                          n_seq_max=n_seq_max, n_pad=n_pad, semantics="2026", kv_unified=unified, buffers=None)
    assert (c.size_base, c.size_swa) == (size_base, cells)


def test_the_tables_cover_every_term():
    """Each term of the rules changes the answer between two rows that differ only in it."""
    def differs_in(table, at):
        rows = dict(table)
        return any(a[:at] + a[at + 1:] == b[:at] + b[at + 1:] and a[at] != b[at] and rows[a] != rows[b]
                   for a in rows for b in rows)

    # n_seq_max, n_ubatch, n_pad, the cap (size_base), swa_full
    assert all(differs_in(SWA_2025, at) for at in (1, 2, 3, 4, 5))
    # n_seq_max, n_ubatch, the cap, swa_full, the stream split; n_pad changes nothing
    assert all(differs_in(SWA_2026, at) for at in (1, 2, 4, 5, 6))
    assert not differs_in(SWA_2026, 3)


# (type, n_embd) -> bytes of one row: n_embd / block elements * block bytes
ROWS = [
    (("f32", 4096), 16384), (("f16", 4096), 8192), (("bf16", 4096), 8192),
    (("q8_0", 4096), 4352), (("q4_0", 4096), 2304), (("q4_1", 4096), 2560),
    (("q5_0", 4096), 2816), (("q5_1", 4096), 3072), (("iq4_nl", 4096), 2304),
    (("f32", 96), 384), (("f16", 96), 192), (("q8_0", 96), 102), (("q4_0", 96), 54),
    (("q4_1", 96), 60), (("q5_0", 96), 66), (("q5_1", 96), 72), (("iq4_nl", 96), 54),
    (("q8_0", 32), 34), (("bf16", 1), 2),
]


@pytest.mark.parametrize("args,row", ROWS, ids=[f"{t}-{n}" for (t, n), _ in ROWS])
def test_row_bytes(args, row):
    t, n_embd = args
    layer = plan.plan_unified(256, 1, n_embd, n_embd, type_k=t, type_v=t, flash_attn=True).caches[0].layers[0]
    assert (layer.k_row_bytes, layer.v_row_bytes) == (row, row)
    c = kvcache.UnifiedCache(64, 1, n_embd, n_embd, type_k=t, type_v=t, v_trans=False, n_pad=1)
    assert c.k(0).nbytes == c.v(0).nbytes == 64 * row
    assert c.size_k_bytes == c.size_v_bytes == 64 * row


# (n_ctx, n_seq_max, flash_attn, semantics, kv_unified) -> (n_pad, kv_size, n_stream). Mid-2025:
# n_pad 256 with flash attention, else 32 (llama_kv_cache_unified::get_padding), the context padded
# to it. Today: no cache padding (1), the context padded to 256; a stream per sequence holds
# n_ctx / n_seq_max cells (0.3.36's log of tests/data/interop-v10/llama_fa0_streams: n_ctx 1024,
# 4 sequences, n_ctx_seq 256)
CONTEXTS = [
    ((4096, 1, False, "2025", True), (32, 4096, 1)),
    ((1000, 1, False, "2025", True), (32, 1024, 1)),
    ((1000, 1, True, "2025", True), (256, 1024, 1)),
    ((1025, 4, False, "2025", True), (32, 1056, 1)),
    ((1025, 4, True, "2025", True), (256, 1280, 1)),
    ((100, 2, False, "2025", True), (32, 128, 1)),
    ((1000, 1, False, "2026", True), (1, 1024, 1)),
    ((1000, 1, True, "2026", True), (1, 1024, 1)),
    ((1025, 4, False, "2026", True), (1, 1280, 1)),
    ((256, 4, False, "2026", True), (1, 256, 1)),
    ((1024, 4, False, "2026", False), (1, 256, 4)),
]


@pytest.mark.parametrize("args,want", CONTEXTS, ids=[str(a) for a, _ in CONTEXTS])
def test_context_cells(args, want):
    n_ctx, n_seq_max, flash_attn, semantics, unified = args
    assert plan.context_cells(n_ctx, n_seq_max, flash_attn, semantics, unified) == want
