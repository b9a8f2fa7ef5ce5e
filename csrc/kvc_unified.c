/* kvcache — the unified cache: construction, sequence operations, the sliding window (see
 * kvc_unified.h). */
#include "kvc_unified.h"
#include "kvc_reuse.h"

#include "kvc_cols.h"
#include "kvc_defrag.h"
#include "kvc_layout.h"
#include "kvc_mask_memo.h"
#include "kvc_types.h"

#include <math.h>
#include <string.h>


/* --- construction -------------------------------------------------------------------- */

int kvc_unified_construct(kvc_unified *c, const kvc_unified_params *p, const kvc_unified_ops *ops, kvc_err *err) {
    memset(c, 0, sizeof *c);
    if (p->n_pad == 0) {
        return kvc_err_set(err, KVC_E_ARG, "n_pad must be positive");
    }
    if (p->kv_size == 0 || p->kv_size % p->n_pad != 0 || p->kv_size > (uint32_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "kv_size (%u) must be a positive multiple of n_pad (%u)",
                           p->kv_size, p->n_pad);
    }
    if (kvc_n_seq_max_check(p->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    const kvc_type_info *tk = kvc_type_get(p->type_k), *tv = kvc_type_get(p->type_v);
    if (!tk) {
        return kvc_err_set(err, KVC_E_ARG, "type_k: unsupported ggml type %d", p->type_k);
    }
    if (!tv) {
        return kvc_err_set(err, KVC_E_ARG, "type_v: unsupported ggml type %d", p->type_v);
    }
    if (p->v_trans && tv->blck_size != 1) {
        return kvc_err_set(err, KVC_E_ARG, "type_v %s cannot be stored transposed (v_trans needs a "
                           "type with one element per block)", tv->name);
    }
    if (p->swa_type != KVC_SWA_NONE && p->swa_type != KVC_SWA_STANDARD && p->swa_type != KVC_SWA_CHUNKED) {
        return kvc_err_set(err, KVC_E_ARG, "swa_type %d is not none, standard or chunked", p->swa_type);
    }
    if (p->swa_type != KVC_SWA_NONE && p->n_swa == 0) {
        return kvc_err_set(err, KVC_E_ARG, "n_swa must be positive with a sliding window");
    }
    if (p->swa_type == KVC_SWA_NONE && p->n_swa != 0) {
        return kvc_err_set(err, KVC_E_ARG, "n_swa (%u) needs a sliding window (swa_type standard or chunked)",
                           p->n_swa);
    }
    for (uint32_t l = 0; l < p->n_layer; l++) {
        if (p->n_embd_k[l] == 0 || p->n_embd_k[l] % tk->blck_size != 0) {
            return kvc_err_set(err, KVC_E_ARG, "n_embd_k_gqa of layer %d (%u) must be a positive multiple "
                               "of %u for type_k %s", p->layer_il[l], p->n_embd_k[l], tk->blck_size, tk->name);
        }
        if (p->n_embd_v[l] == 0 || p->n_embd_v[l] % tv->blck_size != 0) {
            return kvc_err_set(err, KVC_E_ARG, "n_embd_v_gqa of layer %d (%u) must be a positive multiple "
                               "of %u for type_v %s", p->layer_il[l], p->n_embd_v[l], tv->blck_size, tv->name);
        }
    }

    if (!ops) {
        return kvc_err_set(err, KVC_E_ARG, "semantics %d is not 2025 (0) or 2026 (1)", p->semantics);
    }
    if (ops->check && ops->check(p, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (p->ple && !p->cell_ext) {
        return kvc_err_set(err, KVC_E_ARG, "a per-layer-embedding token needs the per-cell extension");
    }
    const uint32_t n_stream = p->stream_per_seq ? p->n_seq_max : 1;
    if ((uint64_t)p->kv_size * n_stream > (uint64_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "kv_size (%u) x %u streams is more than %d cells", p->kv_size,
                           n_stream, INT32_MAX);
    }

    int rc = kvc_state_check_sizes(p->kv_size * n_stream, p->n_seq_max, p->type_k, p->type_v, p->n_layer, p->n_embd_k,
                                   p->n_embd_v, err);
    if (rc != KVC_OK) {
        return rc;
    }

    c->n_seq_max = p->n_seq_max;
    c->n_pad = p->n_pad;
    c->n_swa = p->n_swa;
    c->swa_type = p->swa_type;
    c->type_k = p->type_k;
    c->type_v = p->type_v;
    c->v_trans = p->v_trans;
    c->n_layer = p->n_layer;
    c->vector_moves = kvc_cols_vector_available();   /* the environment is read here, once */
    c->ops = ops;
    c->n_stream = n_stream;
    c->n_defrag_runs = KVC_RUNS_FROM_IDS;

    if (kvc_cells_init(&c->cells, p->kv_size, p->n_seq_max) != KVC_OK) {
        goto nomem;
    }
    if (ops->init && ops->init(c, p) != KVC_OK) {
        goto nomem;
    }
    c->layers = kvc_calloc(p->n_layer ? p->n_layer : 1, sizeof *c->layers);
    c->defrag_ids = kvc_malloc_n(p->kv_size, sizeof *c->defrag_ids);
    if (!c->layers || !c->defrag_ids || kvc_undo_init(&c->undo, c->cells.seq_words) != KVC_OK) {
        goto nomem;
    }
    for (uint32_t l = 0; l < p->n_layer; l++) {
        c->layers[l] = kvc_layer_geometry(p->layer_il[l], p->type_k, p->type_v, p->n_embd_k[l], p->n_embd_v[l]);
    }
    return KVC_OK;

nomem:
    kvc_unified_free(c);
    return kvc_err_set(err, KVC_E_NOMEM, "out of memory creating a cache of %u cells", p->kv_size);
}

int kvc_unified_refuse_streams(const kvc_unified_params *p, kvc_err *err) {
    if (p->stream_per_seq) {
        return kvc_err_set(err, KVC_E_ARG, "kv_unified false (a stream per sequence) needs semantics 2026");
    }
    if (p->cell_ext) {
        return kvc_err_set(err, KVC_E_ARG, "the per-cell extension needs semantics 2026 (the seed's cells have none)");
    }
    return KVC_OK;
}

int kvc_unified_streams_init(kvc_unified *c, const kvc_unified_params *p) {
    const uint32_t n_stream = c->n_stream;
    c->cells.empty_zeroes_shift = true;
    c->more = kvc_calloc(n_stream > 1 ? n_stream - 1 : 1, sizeof *c->more);
    c->scatter.idx = kvc_malloc_n((uint64_t)p->kv_size * n_stream, sizeof *c->scatter.idx);
    c->scatter.strm = kvc_malloc_n(n_stream, sizeof *c->scatter.strm);
    c->cap_copies = 4;
    c->copy_src = kvc_malloc_n(c->cap_copies, sizeof *c->copy_src);
    c->copy_dst = kvc_malloc_n(c->cap_copies, sizeof *c->copy_dst);
    if (!c->more || !c->scatter.idx || !c->scatter.strm || !c->copy_src || !c->copy_dst) {
        return KVC_E_NOMEM;
    }
    c->slot.cells = c->scatter.idx;   /* every placement is scattered */
    for (uint32_t s = 1; s < n_stream; s++) {
        if (kvc_cells_init(&c->more[s - 1].cells, p->kv_size, p->n_seq_max) != KVC_OK) {
            return KVC_E_NOMEM;
        }
        c->more[s - 1].cells.empty_zeroes_shift = true;
    }
    for (uint32_t s = 0; p->cell_ext && s < n_stream; s++) {
        if (kvc_cells_ext_enable(kvc_unified_stream_cells(c, s)) != KVC_OK) {
            return KVC_E_NOMEM;
        }
    }
    c->ple = p->ple;
    c->ple_token = p->ple_token;
    return KVC_OK;
}

void kvc_unified_free(kvc_unified *c) {
    kvc_cells_free(&c->cells);
    if (c->more) {
        for (uint32_t s = 1; s < c->n_stream; s++) {
            kvc_cells_free(&c->more[s - 1].cells);   /* a zeroed table frees nothing */
        }
    }
    kvc_free(c->more);
    kvc_free(c->scatter.idx);
    kvc_free(c->scatter.strm);
    kvc_free(c->copy_src);
    kvc_free(c->copy_dst);
    kvc_free(c->layers);
    kvc_free(c->defrag_ids);
    kvc_free(c->defrag_run_list);
    kvc_undo_free(&c->undo);
    kvc_mask_memo_free(c->mask_memo);
    kvc_reuse_disable(c);
    memset(c, 0, sizeof *c);
}

void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v) {
    c->layers[ikv].k = k;
    c->layers[ikv].v = v;
}

int64_t kvc_unified_layer_index(const kvc_unified *c, int64_t il) {
    return kvc_layers_find(c->layers, c->n_layer, il);
}

int kvc_unified_set_n_threads(kvc_unified *c, uint32_t n, kvc_err *err) {
    if (n > KVC_MAX_THREADS) {
        return kvc_err_set(err, KVC_E_ARG, "n_threads = %u: at most %u (0: as many as useful)", n, KVC_MAX_THREADS);
    }
    c->n_threads = n;
    return KVC_OK;
}

/* --- sequence operations ------------------------------------------------------------- */

void kvc_unified_zero_cells(kvc_unified *c, uint32_t stream, uint32_t from, uint32_t to) {
    const size_t size = c->cells.size, n = to > from ? to - from : 0, base = (size_t)stream * size;
    if (n == 0) {
        return;
    }
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        if (ly->k) {
            memset(ly->k + (base + from) * ly->k_row_bytes, 0, n * ly->k_row_bytes);
        }
        if (!ly->v) {
            continue;
        }
        /* a transposed V keeps per stream n_embd_v rows of size elements, the bytes of size rows */
        uint8_t *v = ly->v + base * ly->v_row_bytes;
        if (!c->v_trans) {
            memset(v + from * ly->v_row_bytes, 0, n * ly->v_row_bytes);
        } else if (n == size) {
            memset(v, 0, size * ly->v_row_bytes); /* every column: the stream's whole V */
        } else {
            for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                memset(v + ((size_t)e * size + from) * el, 0, n * el);
            }
        }
    }
}

void kvc_unified_clear_cells(kvc_unified *c) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_reuse_clear(c);   /* the callers zero or overwrite the K/V */
    for (uint32_t s = 0; s < c->n_stream; s++) {
        kvc_cells_reset(kvc_unified_stream_cells(c, s));
        *kvc_unified_stream_head(c, s) = 0;
    }
}

void kvc_unified_clear(kvc_unified *c) {
    kvc_unified_clear_cells(c);
    if (c->n_stream == 1) {
        kvc_unified_zero_cells(c, 0, 0, c->cells.size);
        return;
    }
    const size_t rows = (size_t)c->cells.size * c->n_stream;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        if (ly->k) {
            memset(ly->k, 0, rows * ly->k_row_bytes);
        }
        if (ly->v) {
            memset(ly->v, 0, rows * ly->v_row_bytes);
        }
    }
}

/* The sequence operations on one cell table and its head (a 2025 cache's only table, or a
 * stream of a 2026 cache). */
static void kvc_table_seq_rm(kvc_cells *cells, uint32_t *head, int32_t s, int32_t p0, int32_t p1) {
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);

    /* nothing of the sequence in the range: no cell changes (the common "absent range" call) */
    if (s >= 0 && !kvc_cells_seq_pos_any_in(cells, s, r)) {
        return;
    }

    if (s >= 0) {
        /* the sequence's cells in the range, from its index */
        new_head = kvc_cells_seq_rm_range(cells, s, r);
    } else {
        for (uint32_t i = 0; i < end; i++) {
            if (!kvc_cells_pos_in(cells, i, r)) {
                continue;
            }
            /* any sequence: the cell goes whatever it holds */
            kvc_cells_seq_or_into(cells, i, &touched);
            kvc_cells_clear_raw(cells, i);
            if (new_head == size) {
                new_head = i;
            }
        }
        /* every cell in the range lost its sequences: drop that slice of their positions */
        const uint32_t nw = cells->seq_words;
        for (int32_t t = kvc_seqset_next(&touched, nw, -1); t >= 0; t = kvc_seqset_next(&touched, nw, t)) {
            kvc_cells_seq_pos_rm_range(cells, t, r);
        }
    }

    if (new_head != size && new_head < *head) {
        *head = new_head;
    }
}

void kvc_unified_stream_seq_rm(kvc_unified *c, uint32_t st, int32_t s, int32_t p0, int32_t p1) {
    kvc_table_seq_rm(kvc_unified_stream_cells(c, st), kvc_unified_stream_head(c, st), s, p0, p1);
}

bool kvc_unified_seq_rm(kvc_unified *c, int32_t s, int32_t p0, int32_t p1) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    if (s >= 0) {
        const uint32_t st = kvc_unified_stream_of(c, s);
        kvc_table_seq_rm(kvc_unified_stream_cells(c, st), kvc_unified_stream_head(c, st), s, p0, p1);
    } else {
        for (uint32_t st = 0; st < c->n_stream; st++) {
            kvc_table_seq_rm(kvc_unified_stream_cells(c, st), kvc_unified_stream_head(c, st), s, p0, p1);
        }
    }
    kvc_reuse_sync_seq(c, s);
    return true;
}

int kvc_unified_seq_cp_check(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err) {
    if (kvc_unified_stream_of(c, src) == kvc_unified_stream_of(c, dst)) {
        return KVC_OK;
    }
    const int64_t last = (int64_t)c->cells.size - 1;
    if ((p0 > 0 && p0 < last) || (p1 > 0 && p1 < last)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_cp across streams copies whole sequences only: [%d, %d) is part "
                           "of a stream of %u cells", p0, p1, c->cells.size);
    }
    if (c->n_copies == c->cap_copies) {
        const uint32_t cap = c->cap_copies * 2;
        uint32_t *a = kvc_realloc_n(c->copy_src, cap, sizeof *a);
        if (!a) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory queueing a stream copy");
        }
        c->copy_src = a;
        uint32_t *b = kvc_realloc_n(c->copy_dst, cap, sizeof *b);
        if (!b) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory queueing a stream copy");
        }
        c->copy_dst = b;
        c->cap_copies = cap;
    }
    return KVC_OK;
}

/* 2026 seq_cp across streams (checked, room reserved): the destination stream becomes the
 * source's cells of src, labelled dst, and the K/V copy is queued for the next update. */
static void kvc_unified_seq_cp_streams(kvc_unified *c, int32_t src, int32_t dst) {
    const uint32_t s0 = kvc_unified_stream_of(c, src), s1 = kvc_unified_stream_of(c, dst);
    const kvc_cells *a = kvc_unified_stream_cells(c, s0);
    kvc_cells *b = kvc_unified_stream_cells(c, s1);
    kvc_reuse_forget_stream(c, s1);   /* the copy overwrites every row of the stream */
    kvc_reuse_copy_cells(c, s0, s1, UINT32_MAX);
    kvc_cells_reset(b);
    for (uint32_t k = kvc_cells_blk_next(a, src, 0, a->used_max_p1); k != UINT32_MAX;
         k = kvc_cells_blk_next(a, src, k + 1, a->used_max_p1)) {
        for (uint64_t m = kvc_cells_blk_cells(a, src, k); m; m &= m - 1) {
            const uint32_t i = (k << 6) + kvc_ctz64(m);
            kvc_cells_pos_set(b, i, a->pos[i]);
            kvc_cells_seq_add(b, i, dst);
            if (b->ext) {
                b->ext[i] = a->ext[i];
            }
            b->shift[i] = a->shift[i];
            b->has_shift = b->has_shift || a->shift[i] != 0;
        }
    }
    *kvc_unified_stream_head(c, s1) = kvc_unified_stream_head_c(c, s0);
    c->copy_src[c->n_copies] = s0;
    c->copy_dst[c->n_copies] = s1;
    c->n_copies++;
}

void kvc_unified_seq_cp(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    if (kvc_unified_stream_of(c, src) != kvc_unified_stream_of(c, dst)) {
        kvc_unified_seq_cp_streams(c, src, dst);
        kvc_reuse_sync(c);
        return;
    }
    kvc_cells *cells = kvc_unified_stream_cells(c, kvc_unified_stream_of(c, src));
    if (src == dst) {
        return;
    }
    kvc_cells_seq_cp_range(cells, src, dst, kvc_pos_range_of(p0, p1));
}

void kvc_unified_seq_keep(kvc_unified *c, int32_t s) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    const uint32_t st = kvc_unified_stream_of(c, s);
    kvc_cells *cells = kvc_unified_stream_cells(c, st);
    uint32_t *head = kvc_unified_stream_head(c, st);
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;

    for (uint32_t i = 0; i < end; i++) {
        if (cells->pos[i] == -1 || kvc_cells_seq_none(cells, i)) {
            continue;
        }
        if (kvc_cells_seq_has(cells, i, s)) {
            kvc_cells_seq_only_raw(cells, i, s);
        } else {
            kvc_cells_clear_raw(cells, i);
            if (new_head == size) {
                new_head = i;
            }
        }
    }
    /* no cell holds any other sequence now */
    for (uint32_t t = 0; t < cells->n_seq_max; t++) {
        if ((int32_t)t != s) {
            kvc_seq_pos_clear(&cells->seq_pos[t]);
            memset(kvc_cells_blk(cells, (int32_t)t), 0, (size_t)cells->blk_words * sizeof *cells->seq_blk);
        }
    }
    if (new_head != size && new_head < *head) {
        *head = new_head;
    }
    kvc_reuse_sync(c);
}

/* The positions of sequence s's cells in r move: pos += shift (d == 0) or pos /= d, for every
 * sequence holding those cells, in one walk over s's blocks. Returns the lowest cell a shift
 * emptied (the table's size when none). */
static uint32_t kvc_move_positions(kvc_unified *c, uint32_t st, int32_t s, kvc_pos_range r, int32_t shift, int32_t d) {
    kvc_cells *cells = kvc_unified_stream_cells(c, st);
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t emptied = size;
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    for (uint32_t b = kvc_cells_blk_next(cells, s, 0, end); b != UINT32_MAX; b = kvc_cells_blk_next(cells, s, b + 1, end)) {
        for (uint64_t m = kvc_cells_blk_cells(cells, s, b); m; m &= m - 1) {
            const uint32_t i = (b << 6) + kvc_ctz64(m);
            if (!kvc_cells_pos_in(cells, i, r)) {
                continue;
            }
            kvc_cells_seq_or_into(cells, i, &touched);
            if (d == 0 || cells->pos[i] / d != cells->pos[i]) {
                kvc_reuse_moved(c, st, i);   /* its K/V belong to the context it was computed in */
            }
            if (d != 0) {
                kvc_cells_pos_div_raw(cells, i, d);
            } else if (kvc_cells_pos_add_raw(cells, i, shift) && emptied == size) {
                emptied = i;
            }
        }
    }
    kvc_cells_rebuild_seq_pos(cells, &touched);
    kvc_reuse_sync(c);
    return emptied;
}

/* The start of a move of positions in [p0, p1) (seq_add, seq_div): a pending defrag settled and
 * the placement dropped, always; *r the range. False when nothing moves: an empty range, or
 * `none` (a shift of 0, a division by 1). */
static bool move_begin(kvc_unified *c, int32_t p0, int32_t p1, bool none, kvc_pos_range *r) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    *r = kvc_pos_range_of(p0, p1);
    return !none && r->p0 != r->p1;
}

void kvc_unified_seq_add(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    kvc_pos_range r;
    if (!move_begin(c, p0, p1, shift == 0, &r)) {
        return;
    }
    const uint32_t st = kvc_unified_stream_of(c, s);
    const uint32_t emptied = kvc_move_positions(c, st, s, r, shift, 0);
    /* a freed cell is where the next search starts; otherwise start from the beginning */
    *kvc_unified_stream_head(c, st) = emptied != c->cells.size ? emptied : 0;
}

void kvc_unified_seq_div(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    kvc_pos_range r;
    if (!move_begin(c, p0, p1, d == 1, &r)) {
        return;
    }
    (void)kvc_move_positions(c, kvc_unified_stream_of(c, s), s, r, 0, d);
}

/* --- the sliding window ------------------------------------------------------------------ */

int kvc_unified_prune_swa(kvc_unified *c, int32_t s, int32_t pmin, int32_t pmax) {
    kvc_cells *cells = &c->cells;
    if (c->swa_type == KVC_SWA_NONE) {
        return KVC_E_ARG;
    }
    kvc_unified_defrag_settle(c);
    int64_t n_attended = 0;
    const uint32_t end = cells->used_max_p1;
    for (uint32_t b = kvc_cells_blk_next(cells, s, 0, end); b != UINT32_MAX; b = kvc_cells_blk_next(cells, s, b + 1, end)) {
        for (uint64_t m = kvc_cells_blk_cells(cells, s, b); m; m &= m - 1) {
            const uint32_t i = (b << 6) + kvc_ctz64(m);
            const int32_t p0 = cells->pos[i];
            if (p0 <= pmin && !kvc_unified_is_masked_swa(c, p0, pmin)) {
                n_attended++;
            }
            if (kvc_unified_is_masked_swa(c, p0, pmax)) {
                kvc_cells_seq_rm(cells, i, s);
            }
        }
    }
    const int64_t need = (int64_t)c->n_swa < pmin ? (int64_t)c->n_swa : pmin;
    return n_attended < need;
}

/* --- attention inputs ------------------------------------------------------------------ */

int32_t kvc_relative_position_bucket(int32_t p0, int32_t p1, uint32_t n_buckets) {
    const int64_t max_distance = 128;
    const int64_t max_exact = n_buckets >> 1;
    int32_t r = p1 - p0; /* query minus key, clamped at 0 (unidirectional) */
    if (r < 0) {
        r = 0;
    }
    if (r < max_exact) {
        return r;
    }
    const float lr = logf((float)((double)r / (double)max_exact));
    const float ld = logf((float)((double)max_distance / (double)max_exact));
    const double v = (double)max_exact + (double)lr * (double)(n_buckets - max_exact) / (double)ld;
    /* 256 or 257 buckets divide by zero (ld == 0): the reference then converts inf or nan to
     * int, which x86 turns into INT32_MIN; do that without undefined behaviour */
    const double f = floor(v);
    int32_t b = (f >= -2147483648.0 && f < 2147483648.0) ? (int32_t)f : INT32_MIN;
    if (b > (int32_t)n_buckets - 1) {
        b = (int32_t)n_buckets - 1;
    }
    return b;
}

void kvc_unified_pos_bucket(const kvc_unified *c, const kvc_ubatch *ub, uint32_t n_buckets, int32_t *out) {
    const uint32_t n_kv = c->ops->n_kv(c);
    for (uint32_t t = 0; t < ub->n_tokens; t++) {
        for (uint32_t i = 0; i < n_kv; i++) {
            out[(size_t)t * n_kv + i] = kvc_relative_position_bucket(c->cells.pos[i], ub->pos[t], n_buckets);
        }
    }
}

void kvc_unified_k_shift(const kvc_unified *c, int32_t *out) {
    const uint32_t size = c->cells.size;
    for (uint32_t s = 0; s < c->n_stream; s++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, s);
        for (uint32_t i = 0; i < size; i++) {
            out[(size_t)s * size + i] = cells->pos[i] == -1 ? 0 : cells->shift[i];
        }
    }
}

/* --- streams (2026) -------------------------------------------------------------------- */

uint32_t kvc_unified_n_kv_seed(const kvc_unified *c) { return c->n; }

uint32_t kvc_unified_n_kv_streams(const kvc_unified *c) { return kvc_unified_stream_n_kv(c, 0); }

uint32_t kvc_unified_stream_n_kv(const kvc_unified *c, uint32_t s) {
    const uint32_t p = c->n_pad > KVC_N_KV_PAD_MIN ? c->n_pad : KVC_N_KV_PAD_MIN;
    const uint64_t u = kvc_unified_stream_cells_c(c, s)->used_max_p1;
    uint64_t n = (u + p - 1) / p * p;
    if (n < p) {
        n = p;
    }
    return n < c->cells.size ? (uint32_t)n : c->cells.size;
}

bool kvc_unified_any_shift(const kvc_unified *c) {
    for (uint32_t s = 0; s < c->n_stream; s++) {
        if (kvc_unified_stream_cells_c(c, s)->has_shift) {
            return true;
        }
    }
    return false;
}

bool kvc_unified_update_2026(kvc_unified *c, uint32_t *copies, bool drop_shifts) {
    const bool had_shift = kvc_unified_any_shift(c);
    *copies = kvc_unified_stream_copies(c);
    if (had_shift && drop_shifts) {
        for (uint32_t s = 0; s < c->n_stream; s++) {
            kvc_cells_reset_shift(kvc_unified_stream_cells(c, s));
        }
    }
    return had_shift;
}

uint32_t kvc_unified_stream_copies(kvc_unified *c) {
    const size_t size = c->cells.size;
    const uint32_t n = c->n_copies;
    for (uint32_t k = 0; k < n; k++) {
        const size_t s0 = c->copy_src[k], s1 = c->copy_dst[k];
        for (uint32_t l = 0; l < c->n_layer; l++) {
            const kvc_layer *ly = &c->layers[l];
            /* a stream's slab is contiguous in both V layouts */
            if (ly->k) {
                memmove(ly->k + s1 * size * ly->k_row_bytes, ly->k + s0 * size * ly->k_row_bytes, size * ly->k_row_bytes);
            }
            if (ly->v) {
                memmove(ly->v + s1 * size * ly->v_row_bytes, ly->v + s0 * size * ly->v_row_bytes, size * ly->v_row_bytes);
            }
        }
    }
    c->n_copies = 0;
    return n;
}

KVC_SEQ_OPS_DEFINE(kvc_unified, kvc_unified);
