#include "kvc_handoff.h"
#include "kvc_defrag.h"

#include "kvc_le.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <inttypes.h>
#include <string.h>

/* magic, version, header bytes, flags, type_k, type_v, n_layer, data bytes, sequence id */
#define FIXED_BYTES 40u
#define LAYER_BYTES 28u
#define RUN_BYTES 8u
#define CELL_BYTES 12u /* without the extension */
#define SUM_BYTES 8u

enum { FLAG_V_TRANS = 1u, FLAG_MEMORY = 2u, FLAG_EXT = 4u, FLAGS_KNOWN = 7u };

/* The source sequence a checked header names. */
static int32_t header_seq(const uint8_t *h) {
    return kvc_le_get_i32(h + 36);
}

uint64_t kvc_handoff_checksum(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325u;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001b3u;
    }
    return h;
}

static size_t v_elem_bytes(const kvc_unified *c) {
    const kvc_type_info *t = kvc_type_get(c->type_v);
    return t ? t->type_size : 0;
}

static uint64_t data_bytes_of(const kvc_unified *c, uint32_t cc) {
    if (!kvc_unified_has_memory(c)) {
        return 0;
    }
    uint64_t n = 0;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        n += (uint64_t)cc * (c->layers[l].k_row_bytes + c->layers[l].v_row_bytes);
    }
    return n;
}

/* --- regions ----------------------------------------------------------------------------- */

typedef void (*region_fn)(void *ctx, uint8_t *addr, size_t len);

/* Every region of the runs' cells of stream `stream`, in the documented order. A stream's K (V)
 * rows start at row stream * size; a transposed V keeps per stream n_embd_v rows of size
 * elements, the same bytes as size rows. */
static void walk_regions(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs, region_fn fn,
                         void *ctx) {
    if (!kvc_unified_has_memory(c)) {
        return;
    }
    const size_t el = v_elem_bytes(c), size = c->cells.size, base = (size_t)stream * size;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        for (uint32_t r = 0; r < n_runs; r++) {
            fn(ctx, ly->k + (base + runs[r].first) * ly->k_row_bytes, (size_t)runs[r].n * ly->k_row_bytes);
        }
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        if (!c->v_trans) {
            for (uint32_t r = 0; r < n_runs; r++) {
                fn(ctx, ly->v + (base + runs[r].first) * ly->v_row_bytes, (size_t)runs[r].n * ly->v_row_bytes);
            }
            continue;
        }
        uint8_t *v = ly->v + base * ly->v_row_bytes;
        for (uint32_t j = 0; j < ly->n_embd_v; j++) {
            for (uint32_t r = 0; r < n_runs; r++) {
                fn(ctx, v + ((size_t)j * size + runs[r].first) * el, (size_t)runs[r].n * el);
            }
        }
    }
}

uint64_t kvc_handoff_n_regions(const kvc_unified *c, uint32_t n_runs) {
    if (!kvc_unified_has_memory(c)) {
        return 0;
    }
    uint64_t n = 0;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        n += (uint64_t)n_runs * (1 + (c->v_trans ? c->layers[l].n_embd_v : 1));
    }
    return n;
}

static void put_region(void *ctx, uint8_t *addr, size_t len) {
    uint64_t **out = ctx;
    (*out)[0] = (uint64_t)(uintptr_t)addr;
    (*out)[1] = (uint64_t)len;
    *out += 2;
}

void kvc_handoff_regions(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs, uint64_t *out) {
    walk_regions(c, stream, runs, n_runs, put_region, &out);
}

static void gather_region(void *ctx, uint8_t *addr, size_t len) {
    uint8_t **out = ctx;
    memcpy(*out, addr, len);
    *out += len;
}

static void scatter_region(void *ctx, uint8_t *addr, size_t len) {
    const uint8_t **src = ctx;
    memcpy(addr, *src, len);
    *src += len;
}

void kvc_handoff_gather(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs, uint8_t *out) {
    walk_regions(c, stream, runs, n_runs, gather_region, &out);
}

void kvc_handoff_scatter(kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs, const uint8_t *src) {
    walk_regions(c, stream, runs, n_runs, scatter_region, &src);
}

/* --- export ------------------------------------------------------------------------------ */

void kvc_handoff_export_free(kvc_handoff_export *e) {
    kvc_free(e->header);
    kvc_free(e->runs);
    memset(e, 0, sizeof *e);
}

/* The layout whose single-sequence state the header's cells follow: the cache type's
 * (kvc_unified_ops.handoff_layout, KVC_HANDOFF_LAYOUT_2025 / _2026). */
static unsigned export_layout(const kvc_unified *c) {
    return c->ops->handoff_layout;
}

/* Bytes of a cell record of the header's cell section: pos, n_seq_id (1), the extension, the id. */
static size_t cell_bytes(bool ext) {
    return CELL_BYTES + (ext ? kvc_layout_ext_bytes(KVC_LAYOUT_EXT_XY | KVC_LAYOUT_EXT_TOK) : 0u);
}

int kvc_handoff_export_make(kvc_unified *c, int32_t s, kvc_handoff_export *e, kvc_err *err) {
    memset(e, 0, sizeof *e);
    kvc_unified_defrag_settle(c);
    const unsigned layout = export_layout(c);
    const uint32_t st = kvc_unified_stream_of(c, s), size = c->cells.size;
    for (uint32_t k = 0; k < kvc_unified_n_stream(c); k++) {
        /* a whole-cache state read may put cells of s in another stream, as llama.cpp does; its
         * sequence state then has several sections, the hand-off's header one */
        if (k != st && kvc_cells_seq_pos_max(kvc_unified_stream_cells_c(c, k), s) >= 0) {
            return kvc_err_set(err, KVC_E_ARG, "sequence %" PRId32 " holds cells in stream %" PRIu32
                               ", not its own (%" PRIu32 "): a hand-off moves one stream; use state_write / "
                               "state_read", s, k, st);
        }
    }
    uint8_t *listed = kvc_malloc(size);
    if (!listed) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory exporting sequence %" PRId32, s);
    }
    const uint32_t cc = kvc_unified_state_listed(c, s, layout, st, listed);
    uint32_t nr = 0;
    for (uint32_t i = 0; i < size; i++) {
        nr += listed[i] && (i == 0 || !listed[i - 1]);
    }
    const bool ext = kvc_unified_has_ext(c);
    const size_t cell_section = 4 + (size_t)cc * cell_bytes(ext);
    const size_t len = FIXED_BYTES + (size_t)c->n_layer * LAYER_BYTES + 4 + (size_t)nr * RUN_BYTES + cell_section +
                       SUM_BYTES;
    e->header = kvc_malloc(len);
    e->runs = nr ? kvc_malloc_n(nr, sizeof *e->runs) : NULL;
    if (!e->header || (nr && !e->runs)) {
        kvc_free(listed);
        kvc_handoff_export_free(e);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory exporting %" PRIu32 " cells", cc);
    }
    uint32_t k = 0;
    bool prev = false;
    for (uint32_t i = 0; i < size; i++) {
        const bool in = listed[i];
        if (in && !prev) {
            e->runs[k].first = i;
            e->runs[k++].n = 0;
        }
        if (in) {
            e->runs[k - 1].n++;
        }
        prev = in;
    }
    kvc_free(listed);
    e->stream = st;
    e->n_runs = nr;
    e->cell_count = cc;
    e->data_bytes = data_bytes_of(c, cc);

    uint8_t *p = e->header;
    kvc_le_put_u32(p, KVC_HANDOFF_MAGIC);
    kvc_le_put_u32(p + 4, KVC_HANDOFF_VERSION);
    kvc_le_put_u32(p + 8, (uint32_t)len);
    kvc_le_put_u32(p + 12, (c->v_trans ? FLAG_V_TRANS : 0u) | (kvc_unified_has_memory(c) ? FLAG_MEMORY : 0u) |
                               (ext ? FLAG_EXT : 0u));
    kvc_le_put_i32(p + 16, c->type_k);
    kvc_le_put_i32(p + 20, c->type_v);
    kvc_le_put_u32(p + 24, c->n_layer);
    kvc_le_put_u64(p + 28, e->data_bytes);
    kvc_le_put_i32(p + 36, s);
    p += FIXED_BYTES;
    for (uint32_t l = 0; l < c->n_layer; l++, p += LAYER_BYTES) {
        const kvc_layer *ly = &c->layers[l];
        kvc_le_put_i32(p, ly->il);
        kvc_le_put_u32(p + 4, ly->n_embd_k);
        kvc_le_put_u32(p + 8, ly->n_embd_v);
        kvc_le_put_u64(p + 12, ly->k_row_bytes);
        kvc_le_put_u64(p + 20, ly->v_row_bytes);
    }
    kvc_le_put_u32(p, nr);
    p += 4;
    for (uint32_t r = 0; r < nr; r++, p += RUN_BYTES) {
        kvc_le_put_u32(p, e->runs[r].first);
        kvc_le_put_u32(p + 4, e->runs[r].n);
    }
    /* the cell section is the codec's: the first bytes of the sequence's state (after the
     * stream count and the empty sections of the streams before the sequence's, in 2026) */
    const uint64_t at = (layout & KVC_LAYOUT_STREAMS) ? 4 + 4 * (uint64_t)st : 0;
    size_t written = 0;
    const int rc = kvc_unified_state_write_range_lay(c, s, layout, at, p, cell_section, &written);
    if (rc != KVC_OK || written != cell_section) {
        kvc_handoff_export_free(e);
        return kvc_err_set(err, rc == KVC_OK ? KVC_E_INTERNAL : rc, "writing the cell section of sequence %" PRId32,
                           s);
    }
    p += cell_section;
    kvc_le_put_u64(p, kvc_handoff_checksum(e->header, (size_t)(p - e->header)));
    e->header_len = len;
    return KVC_OK;
}

/* --- import ------------------------------------------------------------------------------ */

static void import_release(kvc_handoff_import *imp) {
    if (imp->active) {
        imp->c->imports--;
    }
    kvc_free(imp->pos);
    kvc_free(imp->ext);
    kvc_free(imp->runs);
    kvc_free(imp->backup);
    kvc_unified_snapshot_free(&imp->snap);
    for (uint32_t k = 0; k < imp->n_strms; k++) {
        kvc_cells_free(&imp->strms[k]);
    }
    kvc_free(imp->strms);
    kvc_free(imp->heads);
    kvc_free(imp->marks);
    memset(imp, 0, sizeof *imp);
}

/* Check the header's fixed part, layers and runs against c; fills the source runs' count and
 * where the cell section starts. */
static int check_header(const kvc_unified *c, const uint8_t *h, size_t len, uint32_t *n_runs_out,
                        size_t *cells_off, kvc_err *err) {
    if (len < 12) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header truncated: %zu bytes, at least %u needed", len,
                           FIXED_BYTES);
    }
    if (kvc_le_get_u32(h) != KVC_HANDOFF_MAGIC) {
        return kvc_err_set(err, KVC_E_STATE, "not a hand-off header (magic 0x%08" PRIx32 ")", kvc_le_get_u32(h));
    }
    if (kvc_le_get_u32(h + 4) != KVC_HANDOFF_VERSION) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header version %" PRIu32 " (this reader knows %u)",
                           kvc_le_get_u32(h + 4), KVC_HANDOFF_VERSION);
    }
    const uint32_t total = kvc_le_get_u32(h + 8);
    if (len < total) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header truncated: %zu of its %" PRIu32 " bytes", len, total);
    }
    if (len > total) {
        return kvc_err_set(err, KVC_E_STATE, "%zu trailing bytes after the hand-off header (%" PRIu32 " bytes)",
                           len - total, total);
    }
    if (total < FIXED_BYTES + 4 + 4 + SUM_BYTES) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header of %" PRIu32 " bytes: too short to be one", total);
    }
    if (kvc_le_get_u64(h + total - SUM_BYTES) != kvc_handoff_checksum(h, total - SUM_BYTES)) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header corrupted: its checksum does not match its bytes");
    }
    const uint32_t flags = kvc_le_get_u32(h + 12);
    const int32_t tk = kvc_le_get_i32(h + 16), tv = kvc_le_get_i32(h + 20);
    const uint32_t n_layer = kvc_le_get_u32(h + 24);
    if (tk != c->type_k || tv != c->type_v) {
        return kvc_err_set(err, KVC_E_STATE, "the sequence's K/V types are %" PRId32 "/%" PRId32
                           ", the cache's %" PRId32 "/%" PRId32, tk, tv, c->type_k, c->type_v);
    }
    if (flags & ~FLAGS_KNOWN) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header flags 0x%" PRIx32 " (this reader knows 0x%x)", flags,
                           FLAGS_KNOWN);
    }
    if (((flags & FLAG_EXT) != 0) != kvc_unified_has_ext(c)) {
        return kvc_err_set(err, KVC_E_STATE, "the sequence's cells %s the per-cell extension, the cache's %s",
                           flags & FLAG_EXT ? "carry" : "do not carry", kvc_unified_has_ext(c) ? "do" : "do not");
    }
    if (((flags & FLAG_V_TRANS) != 0) != c->v_trans) {
        return kvc_err_set(err, KVC_E_STATE, "the sequence's V is %stransposed, the cache's is %s",
                           flags & FLAG_V_TRANS ? "" : "not ", c->v_trans ? "transposed" : "not");
    }
    if (n_layer != c->n_layer) {
        return kvc_err_set(err, KVC_E_STATE, "the sequence has %" PRIu32 " layers, the cache %" PRIu32, n_layer,
                           c->n_layer);
    }
    size_t off = FIXED_BYTES;
    if ((total - off) / LAYER_BYTES < n_layer) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header too short for %" PRIu32 " layers", n_layer);
    }
    for (uint32_t l = 0; l < n_layer; l++, off += LAYER_BYTES) {
        const kvc_layer *ly = &c->layers[l];
        const uint8_t *p = h + off;
        if (kvc_le_get_i32(p) != ly->il || kvc_le_get_u32(p + 4) != ly->n_embd_k ||
            kvc_le_get_u32(p + 8) != ly->n_embd_v || kvc_le_get_u64(p + 12) != ly->k_row_bytes ||
            kvc_le_get_u64(p + 20) != ly->v_row_bytes) {
            return kvc_err_set(err, KVC_E_STATE,
                               "layer %" PRIu32 " differs: the sequence's is model layer %" PRId32 " with K/V widths %"
                               PRIu32 "/%" PRIu32 ", the cache's model layer %" PRId32 " with %" PRIu32 "/%" PRIu32,
                               l, kvc_le_get_i32(p), kvc_le_get_u32(p + 4), kvc_le_get_u32(p + 8), ly->il, ly->n_embd_k,
                               ly->n_embd_v);
        }
    }
    /* off <= total here (the layers fit); the run count and the checksum must fit too, or the
     * room left for the runs below would wrap around */
    if (total - off < 4 + SUM_BYTES) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header truncated before its runs of cells");
    }
    const uint32_t nr = kvc_le_get_u32(h + off);
    off += 4;
    if ((total - off - SUM_BYTES) / RUN_BYTES < nr) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header too short for %" PRIu32 " runs of cells", nr);
    }
    *n_runs_out = nr;
    *cells_off = off + (size_t)nr * RUN_BYTES;
    return KVC_OK;
}

/* Longest run of empty cells. */
static uint32_t longest_free_run(const kvc_cells *cells) {
    uint32_t best = 0;
    for (uint32_t i = kvc_cells_next_empty(cells, 0, cells->size); i < cells->size;) {
        const uint32_t e = kvc_cells_next_used(cells, i, cells->size);
        best = e - i > best ? e - i : best;
        i = kvc_cells_next_empty(cells, e, cells->size);
    }
    return best;
}

/* The placement of a single-sequence state read: the destination sequence removed, then the
 * cells placed as one ubatch of its positions. 1 placed, 0 no room, KVC_E_NOMEM. dry (not NULL):
 * into a sequence that holds no cell, the placement undone at once, its cells into dry. */
static int place(kvc_unified *c, const kvc_handoff_import *imp, uint32_t *longest, int32_t *dry) {
    const uint32_t seq_off[2] = { 0, 1 };
    const int32_t seq_ids[1] = { imp->seq_id };
    const kvc_ubatch ub = { imp->cell_count, imp->cell_count, 1, imp->pos, seq_off, seq_ids, NULL, NULL, NULL };
    if (dry) {
        return kvc_unified_find_slot_2025_dry(c, &ub, dry, NULL);
    }
    kvc_unified_seq_rm(c, imp->seq_id, -1, -1);
    if (longest) {
        *longest = longest_free_run(&c->cells);
    }
    return kvc_unified_find_slot(c, &ub);
}

/* Cells cells[0, n) (token order) as runs: a run breaks where the next cell is not adjacent. */
static int runs_of_cells(const int32_t *cells, uint32_t n, kvc_handoff_import *imp) {
    uint32_t nr = 0;
    for (uint32_t t = 0; t < n; t++) {
        nr += t == 0 || cells[t] != cells[t - 1] + 1;
    }
    imp->runs = nr ? kvc_malloc_n(nr, sizeof *imp->runs) : NULL;
    if (nr && !imp->runs) {
        return KVC_E_NOMEM;
    }
    uint32_t k = 0;
    for (uint32_t t = 0; t < n; t++) {
        if (t == 0 || cells[t] != cells[t - 1] + 1) {
            imp->runs[k].first = (uint32_t)cells[t];
            imp->runs[k++].n = 0;
        }
        imp->runs[k - 1].n++;
    }
    imp->n_runs = nr;
    return KVC_OK;
}

/* The placed cells as runs, in token order. */
static int runs_of_slot(const kvc_unified *c, kvc_handoff_import *imp) {
    const uint32_t n = kvc_unified_slot_n(c);
    int32_t *cells = kvc_malloc_n(n ? n : 1, sizeof *cells);
    if (!cells) {
        return KVC_E_NOMEM;
    }
    kvc_unified_slot_cells(c, cells);
    const int rc = runs_of_cells(cells, n, imp);
    kvc_free(cells);
    return rc;
}

/* Semantics 2026: the cells a single-sequence state read of the header's cells takes in the
 * sequence's stream (a dry run that leaves the cache as it was, but for what the prefix index
 * evicts to make room, only when evict). An empty sequence reserves nothing: the state read of
 * an empty section keeps the destination's cells. */
int kvc_handoff_reserve_2026(kvc_unified *c, kvc_handoff_import *imp, bool evict, kvc_err *err) {
    const uint32_t cc = imp->cell_count;
    if (cc == 0) {
        return KVC_OK;
    }
    int32_t *cells = kvc_malloc_n(cc, sizeof *cells);
    if (!cells) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory importing %" PRIu32 " cells", cc);
    }
    const kvc_state_sec sec = { imp->stream, cc, 0, (uint32_t)imp->c->v_trans, imp->pos, NULL, NULL };
    uint32_t failed = 0, used = 0;
    const int found = kvc_unified_state_try_place_2026(c, imp->seq_id, &sec, 1, evict, cells, &failed, &used);
    const int rc = found == 1 ? runs_of_cells(cells, cc, imp) : found;
    kvc_free(cells);
    if (found == KVC_ROOM_EVICTING) {
        return found;
    }
    if (found == 0) {
        const uint32_t free_cells = c->cells.size - used;
        return kvc_err_set(err, KVC_E_STATE, "no room: %" PRIu32 " cells missing (sequence %" PRId32 " needs %" PRIu32
                           " free cells in stream %" PRIu32 ", %" PRIu32 " are free without it: neither used nor held by the "
                           "prefix index)",
                           cc > free_cells ? cc - free_cells : 1, imp->seq_id, cc, imp->stream, free_cells);
    }
    if (rc != KVC_OK) {
        return kvc_err_set(err, rc, "out of memory importing %" PRIu32 " cells", cc);
    }
    return KVC_OK;
}

/* Semantics 2025: the dry run of the seed's single-sequence state read, undone (like the state
 * reader's, it settles nothing). */
int kvc_handoff_reserve_2025(kvc_unified *c, kvc_handoff_import *imp, bool evict, kvc_err *err) {
    (void)evict;   /* the seed's cache has no prefix index */
    const uint32_t cc = imp->cell_count;
    if (cc == 0) {
        return KVC_OK;
    }
    uint32_t longest = 0;
    int found;
    if (kvc_unified_seq_pos_max(c, imp->seq_id) < 0) {
        /* a sequence that holds no cell: its removal changes nothing, and the placement is
         * undone from the undo log (O(the cells placed), no copy of the cache) */
        int32_t *cells = kvc_malloc_n(cc, sizeof *cells);
        found = cells ? place(c, imp, NULL, cells) : KVC_E_NOMEM;
        found = found == 1 && runs_of_cells(cells, cc, imp) != KVC_OK ? KVC_E_NOMEM : found;
        longest = found == 0 ? longest_free_run(&c->cells) : 0;
        kvc_free(cells);
    } else {
        kvc_unified_snapshot snap;
        if (kvc_unified_snapshot_take(c, &snap) != KVC_OK) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory importing %" PRIu32 " cells", cc);
        }
        c->defrag_pending = false;
        found = place(c, imp, &longest, NULL);
        found = found == 1 && runs_of_slot(c, imp) != KVC_OK ? KVC_E_NOMEM : found;
        kvc_unified_snapshot_restore(c, &snap);
        kvc_unified_snapshot_free(&snap);
    }
    const int rc = found < 0 ? found : KVC_OK;
    if (found == 0) {
        const uint32_t missing = cc > longest ? cc - longest : 0;
        return kvc_err_set(err, KVC_E_STATE, "no room: %" PRIu32 " cells missing (sequence %" PRId32
                           " needs %" PRIu32 " contiguous free cells, the longest free run is %" PRIu32 ")",
                           missing ? missing : 1, imp->seq_id, cc, longest);
    }
    if (rc != KVC_OK) {
        return kvc_err_set(err, rc, "out of memory importing %" PRIu32 " cells", cc);
    }
    return KVC_OK;
}

static bool same_runs(const kvc_unified *c, const kvc_handoff_import *imp) {
    uint32_t t = 0;
    for (uint32_t r = 0; r < imp->n_runs; r++) {
        for (uint32_t i = 0; i < imp->runs[r].n; i++, t++) {
            if (t >= kvc_unified_slot_n(c) || kvc_unified_slot_cell(c, t) != imp->runs[r].first + i) {
                return false;
            }
        }
    }
    return t == kvc_unified_slot_n(c);
}

static int import_begin_parts(kvc_unified *const *cs, uint32_t n, int32_t seq_id, const uint8_t *const *headers,
                              const size_t *lens, bool keep_bytes, kvc_handoff_import *const *imps, kvc_err *err);

int kvc_handoff_import_begin(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                             kvc_handoff_import *imp, kvc_err *err) {
    return import_begin_parts(&c, 1, seq_id, &header, &len, true, &imp, err);
}

int kvc_handoff_import_begin_parts(kvc_unified *const *cs, uint32_t n, int32_t seq_id, const uint8_t *const *headers,
                                   const size_t *lens, kvc_handoff_import *const *imps, kvc_err *err) {
    return import_begin_parts(cs, n, seq_id, headers, lens, true, imps, err);
}

/* --- imports into an empty sequence without the copy for abort (the prefix store) --------- */

int kvc_handoff_import_begin_empty(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                                   kvc_handoff_import *imp, kvc_err *err) {
    /* the cells reserved for a sequence that holds none are free ones that placement may take
     * (held prefix cells never are): their bytes belong to no sequence and no prefix */
    const bool empty = seq_id >= 0 && (uint32_t)seq_id < c->n_seq_max && kvc_unified_seq_pos_max(c, seq_id) < 0;
    return import_begin_parts(&c, 1, seq_id, &header, &len, !empty, &imp, err);
}

/* ------------------------------------------------------------------------------------------ */

/* The header validated against c into imp (its cells and destination; nothing reserved): KVC_OK,
 * or an error with err and imp released. */
static int import_parse(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len, kvc_handoff_import *imp,
                        kvc_err *err) {
    memset(imp, 0, sizeof *imp);
    uint32_t n_src_runs = 0;
    size_t off = 0;
    int rc = check_header(c, header, header ? len : 0, &n_src_runs, &off, err);
    if (rc != KVC_OK) {
        return rc;
    }
    const size_t total = len;
    if (seq_id < 0) {
        seq_id = header_seq(header);
        if (seq_id < 0 || (uint32_t)seq_id >= c->n_seq_max) {
            return kvc_err_set(err, KVC_E_STATE, "the header's sequence %" PRId32 " is outside this cache's [0, %"
                               PRIu32 "): give the destination seq_id", seq_id, c->n_seq_max);
        }
    }
    /* the source runs: ascending, disjoint, and as many cells as the cell section lists */
    uint64_t run_cells = 0, next = 0;
    for (uint32_t r = 0; r < n_src_runs; r++) {
        const uint8_t *p = header + off - (size_t)(n_src_runs - r) * RUN_BYTES;
        const uint32_t first = kvc_le_get_u32(p), n = kvc_le_get_u32(p + 4);
        if (n == 0 || first < next || (uint64_t)first + n > UINT32_MAX) {
            return kvc_err_set(err, KVC_E_STATE, "run %" PRIu32 " of the source cells ([%" PRIu32 ", +%" PRIu32
                               ")) is empty, out of order or out of range", r, first, n);
        }
        next = (uint64_t)first + n;
        run_cells += n;
    }
    if (total - off - SUM_BYTES < 4) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header truncated before its cell count");
    }
    const uint32_t cc = kvc_le_get_u32(header + off);
    off += 4;
    const bool ext = kvc_unified_has_ext(c);   /* the header's flag says the same (check_header) */
    const size_t cb = cell_bytes(ext);
    if ((total - off - SUM_BYTES) / cb != cc || (total - off - SUM_BYTES) % cb) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header: %" PRIu32 " cells do not fill its %zu bytes of cells",
                           cc, total - off - SUM_BYTES);
    }
    if (run_cells != cc) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header: its runs hold %" PRIu64 " cells, its cell section %"
                           PRIu32, run_cells, cc);
    }
    const uint64_t want = data_bytes_of(c, cc), have = kvc_le_get_u64(header + 28);
    if ((kvc_le_get_u32(header + 12) & FLAG_MEMORY) && want && have != want) {
        return kvc_err_set(err, KVC_E_STATE, "hand-off header: %" PRIu64 " bytes of K/V, the cache needs %" PRIu64
                           " for %" PRIu32 " cells", have, want, cc);
    }
    imp->c = c;
    imp->seq_id = seq_id;
    imp->cell_count = cc;
    imp->pos = cc ? kvc_malloc_n(cc, sizeof *imp->pos) : NULL;
    imp->ext = cc && ext ? kvc_malloc_n(cc, sizeof *imp->ext) : NULL;
    if (cc && (!imp->pos || (ext && !imp->ext))) {
        import_release(imp);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory importing %" PRIu32 " cells", cc);
    }
    for (uint32_t i = 0; i < cc; i++, off += cb) {
        const int32_t pos = kvc_le_get_i32(header + off);
        const uint32_t n_ids = kvc_le_get_u32(header + off + 4);
        if (imp->ext) {
            imp->ext[i].x = kvc_le_get_i32(header + off + 8);
            imp->ext[i].y = kvc_le_get_i32(header + off + 12);
            imp->ext[i].tok = kvc_le_get_i32(header + off + 16);
        }
        if (pos < 0 || n_ids != 1) {
            import_release(imp);
            return kvc_err_set(err, KVC_E_STATE, "cell %" PRIu32 " of the hand-off header: position %" PRId32
                               " with %" PRIu32 " sequence ids (must be >= 0 with 1)", i, pos, n_ids);
        }
        imp->pos[i] = pos;
    }
    imp->stream = kvc_unified_stream_of(c, seq_id);
    return KVC_OK;
}

/* The reserved import takes hold: rows of a pending defrag land before the transfer's, and what
 * its check and abort need is kept. KVC_OK with imp active, or KVC_E_NOMEM with imp released. */
static int import_hold(kvc_handoff_import *imp, bool keep_bytes, kvc_err *err) {
    kvc_unified *c = imp->c;
    const uint32_t cc = imp->cell_count;
    kvc_unified_defrag_settle(c);
    imp->data_bytes = data_bytes_of(c, cc);
    imp->backup = imp->data_bytes && keep_bytes ? kvc_malloc((size_t)imp->data_bytes) : NULL;
    const bool ok = (!imp->data_bytes || !keep_bytes || imp->backup) && c->ops->handoff_save(imp);
    if (!ok) {
        import_release(imp);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory importing %" PRIu32 " cells", cc);
    }
    if (imp->backup) {
        kvc_handoff_gather(c, imp->stream, imp->runs, imp->n_runs, imp->backup);
    }
    imp->active = true;
    c->imports++;
    return KVC_OK;
}

typedef struct reserve_ctx {
    kvc_handoff_import *const *imps;
    kvc_err                   *err;
} reserve_ctx;

static int part_reserve(void *ctx, uint32_t k, bool evict) {
    const reserve_ctx *p = ctx;
    kvc_handoff_import *imp = p->imps[k];
    return imp->c->ops->handoff_reserve(imp->c, imp, evict, p->err);
}

static int import_begin_parts(kvc_unified *const *cs, uint32_t n, int32_t seq_id, const uint8_t *const *headers,
                              const size_t *lens, bool keep_bytes, kvc_handoff_import *const *imps, kvc_err *err) {
    int rc = KVC_OK;
    if (n == 0 || n > KVC_STATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "1 to %d caches expected, got %" PRIu32, KVC_STATE_MAX_PARTS, n);
    }
    for (uint32_t k = 0; k < n; k++) {
        memset(imps[k], 0, sizeof *imps[k]);
    }
    for (uint32_t k = 0; k < n && rc == KVC_OK; k++) {
        rc = import_parse(cs[k], seq_id, headers[k], lens[k], imps[k], err);
        /* the parts of one export name one source sequence (else, without seq_id, they would
         * land in two sequences) */
        if (rc == KVC_OK && k > 0 && header_seq(headers[k]) != header_seq(headers[0])) {
            rc = kvc_err_set(err, KVC_E_STATE, "the hand-off header's parts are of sequences %" PRId32 " and %" PRId32
                             ": not one sequence's export", header_seq(headers[0]), header_seq(headers[k]));
            import_release(imps[k]);
        }
    }
    /* the room of every part, a cache's prefix index evicting only once every part has room or
     * can make it (an import refused for room evicts nothing) */
    if (rc == KVC_OK) {
        const reserve_ctx ctx = { imps, err };
        uint32_t bad = 0;
        rc = kvc_parts_room(n, part_reserve, (void *)&ctx, &bad);
        if (rc != KVC_OK && n > 1) {
            rc = kvc_err_wrap(err, rc, "part %" PRIu32 " of %" PRIu32, bad, n);   /* which cache had no room */
        }
    }
    for (uint32_t j = 0; j < n && rc == KVC_OK; j++) {
        rc = import_hold(imps[j], keep_bytes, err);
    }
    /* on failure the parts that took hold are aborted, the others released */
    for (uint32_t j = 0; j < n && rc != KVC_OK; j++) {
        if (imps[j]->active) {
            kvc_handoff_import_abort(imps[j]);
        } else {
            import_release(imps[j]);
        }
    }
    return rc;
}

/* For an import into a sequence that holds no cell, whose commit places it only on the reserved
 * cells or changes nothing (nothing to put back): each stream's mark, and the fields of the cache
 * besides its cells that the commit's check compares, into the snapshot (which holds no cells
 * then). 1 saved, 0 the sequence holds cells (nothing saved), -1 out of memory. */
static int save_marks(kvc_handoff_import *imp) {
    const kvc_unified *c = imp->c;
    if (kvc_unified_seq_pos_max(c, imp->seq_id) >= 0) {
        return 0;
    }
    imp->marks = kvc_malloc_n(c->n_stream, sizeof *imp->marks);
    if (!imp->marks) {
        return -1;
    }
    for (uint32_t k = 0; k < c->n_stream; k++) {
        const kvc_cells *t = kvc_unified_stream_cells_c(c, k);
        const kvc_handoff_mark m = { t->chg_epoch, t->chg_n, kvc_unified_stream_head_c(c, k), t->has_shift };
        imp->marks[k] = m;
    }
    kvc_unified_snapshot_scalars(c, &imp->snap);
    return 1;
}

bool kvc_handoff_save_2025(kvc_handoff_import *imp) {
    imp->n_copies = imp->c->n_copies;
    const int marked = save_marks(imp);
    return marked ? marked > 0 : kvc_unified_snapshot_take(imp->c, &imp->snap) == KVC_OK;
}

bool kvc_handoff_save_2026(kvc_handoff_import *imp) {
    const kvc_unified *c = imp->c;
    imp->n_copies = c->n_copies;
    const int marked = save_marks(imp);
    if (marked) {
        return marked > 0;
    }
    if (kvc_unified_snapshot_take(c, &imp->snap) != KVC_OK) {
        return false;
    }
    imp->strms = kvc_calloc(c->n_stream, sizeof *imp->strms);
    imp->heads = kvc_malloc_n(c->n_stream, sizeof *imp->heads);
    bool ok = imp->strms && imp->heads;
    for (uint32_t k = 0; ok && k < c->n_stream; k++) {
        /* stream 0's cells are the cache's, which imp->snap holds already (saved_cells) */
        ok = k == 0 || kvc_cells_snapshot(&imp->strms[k], kvc_unified_stream_cells_c(c, k)) == KVC_OK;
        if (ok) {
            imp->n_strms++;
            imp->heads[k] = kvc_unified_stream_head_c(c, k);
        }
    }
    return ok;
}

/* Stream k's cells as the import's begin saved them. */
static const kvc_cells *saved_cells(const kvc_handoff_import *imp, uint32_t k) {
    return k ? &imp->strms[k] : &imp->snap.cells;
}

static bool same_cells(const kvc_cells *a, const kvc_cells *b) {
    const size_t n = a->size;
    return a->used == b->used && a->has_shift == b->has_shift && !memcmp(a->pos, b->pos, n * sizeof *a->pos) &&
           !memcmp(a->shift, b->shift, n * sizeof *a->shift) &&
           kvc_cells_same_sets(a, b) &&
           (!a->ext || !b->ext || !memcmp(a->ext, b->ext, n * sizeof *a->ext));
}

/* Is every stream where its mark says (no cell changed since, no shift reset, the same head)? */
static bool marks_hold(const kvc_handoff_import *imp) {
    const kvc_unified *c = imp->c;
    for (uint32_t k = 0; k < c->n_stream; k++) {
        const kvc_cells *t = kvc_unified_stream_cells_c(c, k);
        const kvc_handoff_mark *m = &imp->marks[k];
        if (t->chg_epoch != m->epoch || t->chg_n != m->chg_n || t->has_shift != m->has_shift ||
            kvc_unified_stream_head_c(c, k) != m->head) {
            return false;
        }
    }
    return c->n_copies == imp->n_copies;
}

/* Is c as at the import's begin (every field the placement reads or an operation changes)? */
static bool unchanged(const kvc_handoff_import *imp) {
    const kvc_unified *c = imp->c;
    const kvc_unified_snapshot *s = &imp->snap;
    if (imp->marks && !marks_hold(imp)) {
        return false;
    }
    for (uint32_t k = 0; k < imp->n_strms; k++) {
        /* (stream 0's cells: with the snapshot's, below) */
        if ((k && !same_cells(kvc_unified_stream_cells_c(c, k), saved_cells(imp, k))) ||
            kvc_unified_stream_head_c(c, k) != imp->heads[k]) {
            return false;
        }
    }
    if (imp->n_strms && c->n_copies != imp->n_copies) {
        return false;
    }
    return c->head == s->head && c->n == s->n && c->slot.head == s->slot.head && c->slot.n == s->slot.n &&
           c->undo.n_spans == s->undo.n_spans && c->undo.n_cells == s->undo.n_cells && c->do_defrag == s->do_defrag &&
           c->defrag_pending == s->defrag_pending && (imp->marks || same_cells(&c->cells, &s->cells));
}

int kvc_handoff_import_check(const kvc_handoff_import *imp, kvc_err *err) {
    if (!imp->active) {
        return kvc_err_set(err, KVC_E_ARG, "the import is no longer active (committed or aborted)");
    }
    if (!unchanged(imp)) {
        return kvc_err_set(err, KVC_E_STATE, "the cache changed since the import began: abort it and begin again");
    }
    return KVC_OK;
}

int kvc_handoff_import_commit(kvc_handoff_import *imp, kvc_err *err) {
    const int rc = kvc_handoff_import_check(imp, err);
    if (rc != KVC_OK) {
        return rc;
    }
    const int placed = imp->c->ops->handoff_place(imp, err);
    if (placed != KVC_OK) {
        return placed;
    }
    import_release(imp);
    return KVC_OK;
}

int kvc_handoff_place_2026(kvc_handoff_import *imp, kvc_err *err) {
    kvc_unified *c = imp->c;
    /* the state read's placement on the same cells as the dry run: the same cells (an empty
     * sequence's read changes nothing, not even the last placement) */
    if (imp->cell_count && imp->marks) {
        /* into a sequence that held no cell: placed only on the reserved cells, else nothing changed */
        int32_t *want = kvc_malloc_n(imp->cell_count, sizeof *want);
        if (!want) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory importing %" PRIu32 " cells", imp->cell_count);
        }
        for (uint32_t r = 0, t = 0; r < imp->n_runs; r++) {
            for (uint32_t i = 0; i < imp->runs[r].n; i++) {
                want[t++] = (int32_t)(imp->runs[r].first + i);
            }
        }
        const int placed = kvc_unified_state_place_2026_at(c, imp->seq_id, imp->cell_count, imp->pos, want);
        kvc_free(want);
        if (placed != 1) {
            return kvc_err_set(err, KVC_E_INTERNAL, "the placement differs from the dry run's");
        }
    } else if (imp->cell_count &&
               (kvc_unified_state_place_2026(c, imp->seq_id, imp->cell_count, imp->pos, true) != 1 || !same_runs(c, imp))) {
        kvc_cells_copy(kvc_unified_stream_cells(c, imp->stream), saved_cells(imp, imp->stream));
        *kvc_unified_stream_head(c, imp->stream) = imp->heads[imp->stream];
        kvc_unified_snapshot_restore(c, &imp->snap);
        return kvc_err_set(err, KVC_E_INTERNAL, "the placement differs from the dry run's");
    }
    if (imp->cell_count) {
        kvc_unified_state_put_ext_2026(c, imp->stream, imp->cell_count, imp->ext);
        kvc_unified_slot_drop(c);
    }
    return KVC_OK;
}

int kvc_handoff_place_2025(kvc_handoff_import *imp, kvc_err *err) {
    kvc_unified *c = imp->c;
    if (imp->cell_count == 0) {
        kvc_unified_seq_rm(c, imp->seq_id, -1, -1);   /* an empty sequence removes it, as the state read */
        return KVC_OK;
    }
    /* the same search on the same cells as the dry run: the same cells, no allocation */
    kvc_unified_mark mark;
    kvc_unified_mark_take(c, &mark);
    const int found = place(c, imp, NULL, NULL);
    if (found != 1 || !same_runs(c, imp)) {
        if (imp->marks && found == 1) {
            (void)kvc_unified_rewind(c, &mark);   /* the sequence held no cell: the placement undone */
        } else if (!imp->marks) {
            kvc_unified_snapshot_restore(c, &imp->snap);
        }
        return kvc_err_set(err, found < 0 ? found : KVC_E_INTERNAL, "the placement differs from the dry run's");
    }
    kvc_unified_commit(c);
    kvc_unified_slot_drop(c);
    return KVC_OK;
}

void kvc_handoff_import_abort(kvc_handoff_import *imp) {
    if (!imp->active) {
        return;
    }
    if (imp->backup) {
        kvc_handoff_scatter(imp->c, imp->stream, imp->runs, imp->n_runs, imp->backup);
    }
    import_release(imp);
}
