/* kvcache — the unified cache: construction, sequence operations, the sliding window (see
 * kvc_unified.h). */
#include "kvc_unified.h"

#include "kvc_cols.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <math.h>
#include <string.h>


/* --- construction -------------------------------------------------------------------- */

int kvc_unified_init(kvc_unified *c, const kvc_unified_params *p, kvc_err *err) {
    memset(c, 0, sizeof *c);
    if (p->n_pad == 0) {
        return kvc_err_set(err, KVC_E_ARG, "n_pad must be positive");
    }
    if (p->kv_size == 0 || p->kv_size % p->n_pad != 0 || p->kv_size > (uint32_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "kv_size (%u) must be a positive multiple of n_pad (%u)",
                           p->kv_size, p->n_pad);
    }
    if (p->n_seq_max == 0 || p->n_seq_max > KVC_MAX_SEQ) {
        return kvc_err_set(err, KVC_E_ARG, "n_seq_max (%u) must be in [1, %d]", p->n_seq_max, KVC_MAX_SEQ);
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

    int rc = kvc_state_check_sizes(p->kv_size, p->n_seq_max, p->type_k, p->type_v, p->n_layer, p->n_embd_k,
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

    if (kvc_cells_init(&c->cells, p->kv_size, p->n_seq_max) != KVC_OK) {
        goto nomem;
    }
    c->layers = kvc_calloc(p->n_layer ? p->n_layer : 1, sizeof *c->layers);
    c->defrag_ids = kvc_malloc_n(p->kv_size, sizeof *c->defrag_ids);
    if (!c->layers || !c->defrag_ids || kvc_undo_init(&c->undo, c->cells.seq_words) != KVC_OK) {
        goto nomem;
    }
    for (uint32_t l = 0; l < p->n_layer; l++) {
        kvc_layer *ly = &c->layers[l];
        ly->il = p->layer_il[l];
        ly->n_embd_k = p->n_embd_k[l];
        ly->n_embd_v = p->n_embd_v[l];
        ly->k_row_bytes = kvc_row_size(p->type_k, p->n_embd_k[l]);
        ly->v_row_bytes = kvc_row_size(p->type_v, p->n_embd_v[l]);
    }
    return KVC_OK;

nomem:
    kvc_unified_free(c);
    return kvc_err_set(err, KVC_E_NOMEM, "out of memory creating a cache of %u cells", p->kv_size);
}

void kvc_unified_free(kvc_unified *c) {
    kvc_cells_free(&c->cells);
    kvc_free(c->layers);
    kvc_free(c->defrag_ids);
    kvc_undo_free(&c->undo);
    memset(c, 0, sizeof *c);
}

void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v) {
    c->layers[ikv].k = k;
    c->layers[ikv].v = v;
}

int kvc_unified_set_n_threads(kvc_unified *c, uint32_t n, kvc_err *err) {
    if (n > KVC_MAX_THREADS) {
        return kvc_err_set(err, KVC_E_ARG, "n_threads = %u: at most %u (0: as many as useful)", n, KVC_MAX_THREADS);
    }
    c->n_threads = n;
    return KVC_OK;
}

/* --- sequence operations ------------------------------------------------------------- */

void kvc_unified_zero_cells(kvc_unified *c, uint32_t from, uint32_t to) {
    const size_t size = c->cells.size, n = to > from ? to - from : 0;
    if (n == 0) {
        return;
    }
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        if (ly->k) {
            memset(ly->k + from * ly->k_row_bytes, 0, n * ly->k_row_bytes);
        }
        if (!ly->v) {
            continue;
        }
        if (!c->v_trans) {
            memset(ly->v + from * ly->v_row_bytes, 0, n * ly->v_row_bytes);
        } else if (n == size) {
            memset(ly->v, 0, size * ly->v_row_bytes); /* every column: the whole buffer */
        } else {
            for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                memset(ly->v + ((size_t)e * size + from) * el, 0, n * el);
            }
        }
    }
}

void kvc_unified_clear(kvc_unified *c) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells_reset(&c->cells);
    c->head = 0;
    kvc_unified_zero_cells(c, 0, c->cells.size);
}

bool kvc_unified_seq_rm(kvc_unified *c, int32_t s, int32_t p0, int32_t p1) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);

    /* nothing of the sequence in the range: no cell changes (the common "absent range" call) */
    if (s >= 0 && !kvc_cells_seq_pos_any_in(cells, s, r)) {
        return true;
    }

    for (uint32_t i = 0; i < end; i++) {
        if (!kvc_cells_pos_in(cells, i, r)) {
            continue;
        }
        if (s < 0) {
            /* any sequence: the cell goes whatever it holds */
            kvc_cells_seq_or_into(cells, i, &touched);
            kvc_cells_clear_raw(cells, i);
        } else if (kvc_cells_seq_has(cells, i, s)) {
            if (!kvc_cells_seq_del_raw(cells, i, s)) {
                continue;
            }
        } else {
            continue;
        }
        if (new_head == size) {
            new_head = i;
        }
    }

    /* every cell holding the sequence within the range lost it: drop that slice of positions */
    if (s >= 0) {
        kvc_cells_seq_pos_rm_range(cells, s, r);
    } else {
        const uint32_t nw = cells->seq_words;
        for (int32_t t = kvc_seqset_next(&touched, nw, -1); t >= 0; t = kvc_seqset_next(&touched, nw, t)) {
            kvc_cells_seq_pos_rm_range(cells, t, r);
        }
    }

    if (new_head != size && new_head < c->head) {
        c->head = new_head;
    }
    return true;
}

void kvc_unified_seq_cp(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells *cells = &c->cells;
    if (src == dst) {
        return;
    }
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    bool any = false;
    for (uint32_t i = 0; i < cells->used_max_p1; i++) {
        if (kvc_cells_pos_in(cells, i, r) && kvc_cells_seq_has(cells, i, src) && !kvc_cells_seq_has(cells, i, dst)) {
            kvc_seqs_add(cells->seq, cells->size, i, dst);
            any = true;
        }
    }
    if (any) {
        kvc_seqset only;
        kvc_seqset_clear(&only);
        kvc_seqset_add(&only, dst);
        kvc_cells_rebuild_seq_pos(cells, &only);
    }
}

void kvc_unified_seq_keep(kvc_unified *c, int32_t s) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells *cells = &c->cells;
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
            cells->seq_pos[t].n = 0;
        }
    }
    if (new_head != size && new_head < c->head) {
        c->head = new_head;
    }
}

void kvc_unified_seq_add(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells *cells = &c->cells;
    if (shift == 0) {
        return;
    }
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    if (r.p0 == r.p1) {
        return;
    }
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    for (uint32_t i = 0; i < end; i++) {
        if (!kvc_cells_pos_in(cells, i, r) || !kvc_cells_seq_has(cells, i, s)) {
            continue;
        }
        kvc_cells_seq_or_into(cells, i, &touched);
        if (kvc_cells_pos_add_raw(cells, i, shift) && new_head == size) {
            new_head = i;
        }
    }
    kvc_cells_rebuild_seq_pos(cells, &touched);
    /* a freed cell is where the next search starts; otherwise start from the beginning */
    c->head = new_head != size ? new_head : 0;
}

void kvc_unified_seq_div(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    kvc_cells *cells = &c->cells;
    if (d == 1) {
        return;
    }
    const kvc_pos_range r = kvc_pos_range_of(p0, p1);
    if (r.p0 == r.p1) {
        return;
    }
    kvc_seqset touched;
    kvc_seqset_clear(&touched);
    for (uint32_t i = 0; i < cells->used_max_p1; i++) {
        if (kvc_cells_pos_in(cells, i, r) && kvc_cells_seq_has(cells, i, s)) {
            kvc_cells_seq_or_into(cells, i, &touched);
            kvc_cells_pos_div_raw(cells, i, d);
        }
    }
    kvc_cells_rebuild_seq_pos(cells, &touched);
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
    for (uint32_t i = 0; i < end; i++) {
        if (cells->pos[i] == -1 || !kvc_cells_seq_has(cells, i, s)) {
            continue;
        }
        const int32_t p0 = cells->pos[i];
        if (p0 <= pmin && !kvc_unified_is_masked_swa(c, p0, pmin)) {
            n_attended++;
        }
        if (kvc_unified_is_masked_swa(c, p0, pmax)) {
            kvc_cells_seq_rm(cells, i, s);
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
    const uint32_t n_kv = c->n;
    for (uint32_t t = 0; t < ub->n_tokens; t++) {
        for (uint32_t i = 0; i < n_kv; i++) {
            out[(size_t)t * n_kv + i] = kvc_relative_position_bucket(c->cells.pos[i], ub->pos[t], n_buckets);
        }
    }
}

void kvc_unified_k_shift(const kvc_unified *c, int32_t *out) {
    for (uint32_t i = 0; i < c->cells.size; i++) {
        out[i] = c->cells.pos[i] == -1 ? 0 : c->cells.shift[i];
    }
}
