#include "kvc_unified.h"

#include "kvc_cols.h"
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

    c->n_seq_max = p->n_seq_max;
    c->n_pad = p->n_pad;
    c->n_swa = p->n_swa;
    c->swa_type = p->swa_type;
    c->type_k = p->type_k;
    c->type_v = p->type_v;
    c->v_trans = p->v_trans;
    c->n_layer = p->n_layer;

    if (kvc_cells_init(&c->cells, p->kv_size, p->n_seq_max) != KVC_OK) {
        goto nomem;
    }
    c->layers = kvc_calloc(p->n_layer ? p->n_layer : 1, sizeof *c->layers);
    c->defrag_ids = kvc_malloc((size_t)p->kv_size * sizeof *c->defrag_ids);
    c->cap_rec = 4;
    c->rec = kvc_malloc(c->cap_rec * sizeof *c->rec);
    c->cap_rec_arena = 64;
    c->rec_pos = kvc_malloc(c->cap_rec_arena * sizeof *c->rec_pos);
    c->rec_seq = kvc_malloc(c->cap_rec_arena * sizeof *c->rec_seq);
    if (!c->layers || !c->defrag_ids || !c->rec || !c->rec_pos || !c->rec_seq) {
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
    kvc_free(c->rec);
    kvc_free(c->rec_pos);
    kvc_free(c->rec_seq);
    memset(c, 0, sizeof *c);
}

void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v) {
    c->layers[ikv].k = k;
    c->layers[ikv].v = v;
}

/* --- sequence operations ------------------------------------------------------------- */

static inline void kvc_clamp_range(int32_t *p0, int32_t *p1) {
    if (*p0 < 0) {
        *p0 = 0;
    }
    if (*p1 < 0) {
        *p1 = KVC_POS_MAX;
    }
}

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
    kvc_cells_reset(&c->cells);
    c->head = 0;
    kvc_unified_zero_cells(c, 0, c->cells.size);
}

bool kvc_unified_seq_rm(kvc_unified *c, int32_t s, int32_t p0, int32_t p1) {
    kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;
    uint64_t touched = 0;

    kvc_clamp_range(&p0, &p1);

    /* nothing of the sequence in [p0, p1): no cell changes (the common "absent range" call) */
    if (s >= 0 && !kvc_cells_seq_pos_any_in(cells, s, p0, p1)) {
        return true;
    }

    for (uint32_t i = 0; i < end; i++) {
        if (!kvc_cells_pos_in(cells, i, p0, p1)) {
            continue;
        }
        if (s < 0) {
            /* any sequence: the cell goes whatever it holds */
            touched |= cells->seq[i];
            kvc_cells_clear_raw(cells, i);
        } else if (kvc_cells_seq_has(cells, i, s)) {
            cells->seq[i] &= ~((uint64_t)1 << s);
            if (cells->seq[i] != 0) {
                continue;
            }
            kvc_cells_clear_raw(cells, i);
        } else {
            continue;
        }
        if (new_head == size) {
            new_head = i;
        }
    }

    /* every cell holding the sequence within [p0, p1) lost it: drop that slice of positions */
    if (s >= 0) {
        kvc_cells_seq_pos_rm_range(cells, s, p0, p1);
    } else {
        for (uint64_t m = touched; m; m &= m - 1) {
            kvc_cells_seq_pos_rm_range(cells, (int32_t)kvc_ctz64(m), p0, p1);
        }
    }

    if (new_head != size && new_head < c->head) {
        c->head = new_head;
    }
    return true;
}

void kvc_unified_seq_cp(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    kvc_cells *cells = &c->cells;
    if (src == dst) {
        return;
    }
    kvc_clamp_range(&p0, &p1);
    const uint64_t bsrc = (uint64_t)1 << src, bdst = (uint64_t)1 << dst;
    bool any = false;
    for (uint32_t i = 0; i < cells->used_max_p1; i++) {
        if (kvc_cells_pos_in(cells, i, p0, p1) && (cells->seq[i] & bsrc) && !(cells->seq[i] & bdst)) {
            cells->seq[i] |= bdst;
            any = true;
        }
    }
    if (any) {
        kvc_cells_rebuild_seq_pos(cells, bdst);
    }
}

void kvc_unified_seq_keep(kvc_unified *c, int32_t s) {
    kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size, end = cells->used_max_p1;
    const uint64_t bit = (uint64_t)1 << s;
    uint32_t new_head = size;

    for (uint32_t i = 0; i < end; i++) {
        if (cells->pos[i] == -1 || cells->seq[i] == 0) {
            continue;
        }
        if (cells->seq[i] & bit) {
            cells->seq[i] = bit;
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
    kvc_cells *cells = &c->cells;
    if (shift == 0) {
        return;
    }
    const uint32_t size = cells->size, end = cells->used_max_p1;
    uint32_t new_head = size;
    kvc_clamp_range(&p0, &p1);
    if (p0 == p1) {
        return;
    }
    uint64_t touched = 0;
    for (uint32_t i = 0; i < end; i++) {
        if (!kvc_cells_pos_in(cells, i, p0, p1) || !kvc_cells_seq_has(cells, i, s)) {
            continue;
        }
        touched |= cells->seq[i];
        if (kvc_cells_pos_add_raw(cells, i, shift) && new_head == size) {
            new_head = i;
        }
    }
    kvc_cells_rebuild_seq_pos(cells, touched);
    /* a freed cell is where the next search starts; otherwise start from the beginning */
    c->head = new_head != size ? new_head : 0;
}

void kvc_unified_seq_div(kvc_unified *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {
    kvc_cells *cells = &c->cells;
    if (d == 1) {
        return;
    }
    kvc_clamp_range(&p0, &p1);
    if (p0 == p1) {
        return;
    }
    uint64_t touched = 0;
    for (uint32_t i = 0; i < cells->used_max_p1; i++) {
        if (kvc_cells_pos_in(cells, i, p0, p1) && kvc_cells_seq_has(cells, i, s)) {
            touched |= cells->seq[i];
            kvc_cells_pos_div_raw(cells, i, d);
        }
    }
    kvc_cells_rebuild_seq_pos(cells, touched);
}

/* --- slot search and recovery -------------------------------------------------------- */

/* Make room for one more recovery entry of n cells (before anything changes). */
static int kvc_unified_reserve_recovery(kvc_unified *c, uint32_t n) {
    if (c->n_rec == c->cap_rec) {
        const uint32_t cap = c->cap_rec * 2;
        kvc_recovery *r = kvc_realloc(c->rec, cap * sizeof *r);
        if (!r) {
            return KVC_E_NOMEM;
        }
        c->rec = r;
        c->cap_rec = cap;
    }
    if ((uint64_t)c->n_rec_arena + n > c->cap_rec_arena) {
        uint64_t cap = c->cap_rec_arena;
        while (cap < (uint64_t)c->n_rec_arena + n) {
            cap *= 2;
        }
        if (cap > UINT32_MAX) {
            return KVC_E_NOMEM;
        }
        int32_t *rp = kvc_realloc(c->rec_pos, (size_t)cap * sizeof *rp);
        if (!rp) {
            return KVC_E_NOMEM;
        }
        c->rec_pos = rp;
        uint64_t *rs = kvc_realloc(c->rec_seq, (size_t)cap * sizeof *rs);
        if (!rs) {
            return KVC_E_NOMEM;
        }
        c->rec_seq = rs;
        c->cap_rec_arena = (uint32_t)cap;
    }
    return KVC_OK;
}

/* The seed's search loop, with runs of used cells skipped 64 at a time. `n_tested` counts the
 * cells the head has travelled over; the search gives up once it reaches the cache size
 * (checked only after a failed window, as the seed does). */
static bool kvc_unified_search(kvc_unified *c, uint32_t n_tokens) {
    const kvc_cells *cells = &c->cells;
    const uint32_t size = cells->size;
    uint64_t n_tested = 0;
    uint32_t head = c->head;
    bool found;

    for (;;) {
        if ((uint64_t)head + n_tokens > size) {
            n_tested += size - head;
            head = 0;
            continue;
        }
        const uint32_t j = kvc_cells_next_used(cells, head, head + n_tokens);
        if (j == head + n_tokens) {
            found = true;
            break;
        }
        n_tested += (uint64_t)j + 1 - head;
        head = j + 1;
        if (n_tested >= size) {
            found = false;
            break;
        }
        /* the seed steps over used cells one at a time while the window still fits */
        const uint32_t last_fit = size - n_tokens;
        if (head <= last_fit) {
            uint32_t stop = kvc_cells_next_empty(cells, head, last_fit + 1);
            const uint64_t steps = stop - head;
            if (n_tested + steps >= size) {
                head += (uint32_t)(size - n_tested);
                found = false;
                break;
            }
            n_tested += steps;
            head = stop;
        }
    }
    c->head = head;
    return found;
}

int kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub) {
    kvc_cells *cells = &c->cells;
    const uint32_t n_tokens = ub->n_tokens;

    if (n_tokens <= cells->size && kvc_unified_reserve_recovery(c, n_tokens) != KVC_OK) {
        return KVC_E_NOMEM;
    }

    /* plenty of free cells before head: search from the beginning, hoping to fill it */
    if ((uint64_t)c->head > (uint64_t)cells->used + 2 * (uint64_t)n_tokens) {
        c->head = 0;
    }
    if (n_tokens > cells->size) {
        return 0;
    }
    if (!kvc_unified_search(c, n_tokens)) {
        return 0;
    }

    const uint32_t head = c->head;
    kvc_recovery *r = &c->rec[c->n_rec++];
    r->i = head;
    r->n = n_tokens;
    r->off = c->n_rec_arena;
    memcpy(c->rec_pos + r->off, cells->pos + head, (size_t)n_tokens * sizeof *cells->pos);
    memcpy(c->rec_seq + r->off, cells->seq + head, (size_t)n_tokens * sizeof *cells->seq);
    c->n_rec_arena += n_tokens;

    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint32_t g = t / ub->n_seq_tokens;
        kvc_cells_pos_set(cells, head + t, ub->pos[t]);
        for (uint32_t k = ub->seq_off[g]; k < ub->seq_off[g + 1]; k++) {
            kvc_cells_seq_add(cells, head + t, ub->seq_ids[k]);
        }
    }

    /* attend only to the part of the cache in use, padded */
    uint32_t n = kvc_pad_u32(cells->used_max_p1, c->n_pad);
    if (n < c->n_pad) {
        n = c->n_pad;
    }
    c->n = n < cells->size ? n : cells->size;
    return 1;
}

void kvc_unified_commit(kvc_unified *c) {
    c->n_rec = 0;
    c->n_rec_arena = 0;
}

void kvc_unified_restore(kvc_unified *c) {
    kvc_cells *cells = &c->cells;
    uint64_t touched = 0;
    for (uint32_t k = 0; k < c->n_rec; k++) {
        const kvc_recovery *r = &c->rec[k];
        for (uint32_t j = 0; j < r->n; j++) {
            touched |= cells->seq[r->i + j] | c->rec_seq[r->off + j];
            kvc_cells_set_raw(cells, r->i + j, c->rec_pos[r->off + j], c->rec_seq[r->off + j]);
        }
    }
    kvc_cells_rebuild_seq_pos(cells, touched);
    kvc_unified_commit(c);
}

void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m) {
    m->head = c->head;
    m->n = c->n;
    m->n_rec = c->n_rec;
    m->n_rec_arena = c->n_rec_arena;
}

int kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m) {
    kvc_cells *cells = &c->cells;
    if (c->n_rec < m->n_rec || c->n_rec_arena < m->n_rec_arena) {
        return KVC_E_ARG;
    }
    uint64_t touched = 0;
    /* newest first, so that a cell written twice ends as the oldest snapshot had it */
    for (uint32_t k = c->n_rec; k-- > m->n_rec;) {
        const kvc_recovery *r = &c->rec[k];
        for (uint32_t j = 0; j < r->n; j++) {
            touched |= cells->seq[r->i + j] | c->rec_seq[r->off + j];
            kvc_cells_set_raw(cells, r->i + j, c->rec_pos[r->off + j], c->rec_seq[r->off + j]);
        }
    }
    kvc_cells_rebuild_seq_pos(cells, touched);
    c->n_rec = m->n_rec;
    c->n_rec_arena = m->n_rec_arena;
    c->head = m->head;
    c->n = m->n;
    return KVC_OK;
}

void kvc_unified_set_full(kvc_unified *c) {
    c->n = c->cells.size;
    c->head = 0;
}

/* --- data ------------------------------------------------------------------------------ */

void kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v) {
    const kvc_layer *ly = &c->layers[ikv];
    const size_t head = c->head, size = c->cells.size;
    if (k && ly->k) {
        memcpy(ly->k + head * ly->k_row_bytes, k, n_tokens * ly->k_row_bytes);
    }
    if (!v || !ly->v) {
        return;
    }
    if (!c->v_trans) {
        memcpy(ly->v + head * ly->v_row_bytes, v, n_tokens * ly->v_row_bytes);
        return;
    }
    /* transposed: element e of token t goes to row e, column head + t */
    const size_t el = kvc_type_get(c->type_v)->type_size;
    const uint8_t *src = v;
    for (uint32_t e = 0; e < ly->n_embd_v; e++) {
        uint8_t *dst = ly->v + ((size_t)e * size + head) * el;
        for (uint32_t t = 0; t < n_tokens; t++) {
            memcpy(dst + (size_t)t * el, src + ((size_t)t * ly->n_embd_v + e) * el, el);
        }
    }
}

int kvc_unified_prune_swa(kvc_unified *c, int32_t s, int32_t pmin, int32_t pmax) {
    kvc_cells *cells = &c->cells;
    if (c->swa_type == KVC_SWA_NONE) {
        return KVC_E_ARG;
    }
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

bool kvc_unified_is_masked_swa(const kvc_unified *c, int32_t p0, int32_t p1) {
    switch (c->swa_type) {
    case KVC_SWA_STANDARD:
        return (int64_t)p1 - p0 >= (int64_t)c->n_swa;
    case KVC_SWA_CHUNKED: {
        const int64_t chunk_start = ((int64_t)p1 / c->n_swa) * c->n_swa;
        return p0 < chunk_start;
    }
    default:
        return false;
    }
}

/* The window of key positions [lo, hi] a query at p1 may see. */
static inline void kvc_unified_visible_range(const kvc_unified *c, int32_t p1, bool causal, int32_t *lo, int32_t *hi) {
    int64_t l = 0;
    if (c->swa_type == KVC_SWA_STANDARD) {
        l = (int64_t)p1 - c->n_swa + 1;       /* masked when p1 - p0 >= n_swa */
    } else if (c->swa_type == KVC_SWA_CHUNKED) {
        l = ((int64_t)p1 / c->n_swa) * c->n_swa; /* masked before the chunk start */
    }
    *lo = (int32_t)(l > 0 ? l : 0);
    *hi = causal ? p1 : INT32_MAX;
}

/* One sequence of the ubatch, as the mask sees it. A row of a sequence with several tokens is
 * a copy of its base row (the cells every one of its tokens sees) plus the few "edge" cells
 * whose key position lies where the tokens' windows differ: built once, each row then costs
 * about as much as writing it. Sequences whose edges are many (or ALiBi, whose values differ
 * in every visible cell) have their rows computed from the key positions directly. */
typedef struct kvc_mask_seq {
    const int32_t *vis;          /* key position of each cell in this sequence, -1 elsewhere */
    bool           use_edges;    /* rows are copies of base plus edges; else computed from vis */
    uint8_t       *base;
    uint32_t      *edge;         /* edge cells */
    uint32_t       n_edge;
    uint32_t       n_tokens;
    /* over the tokens' windows [lo, hi]: min lo, max lo, min hi, max hi. The base row shows
     * [max lo, min hi]; the edges are the key positions in [min lo, max lo) or (min hi, max hi]. */
    int32_t        edge_range[4];
} kvc_mask_seq;

/* Edges are worth it while a row patches at most this fraction of its cells. */
#define KVC_MASK_EDGE_DIV 16u
/* ... and while the sequence has enough rows to pay for building its base row. */
#define KVC_MASK_MIN_ROWS 8u

int kvc_unified_kq_mask(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, void *out) {
    const kvc_cells *cells = &c->cells;
    const uint32_t n_kv = c->n, n_tokens = ub->n_tokens;
    const uint32_t rows = kvc_pad_u32(n_tokens, KVC_KQ_MASK_PAD);
    const size_t el = kvc_mask_elsize(dtype);
    const size_t row_bytes = (size_t)n_kv * el;
    /* masks larger than the last-level cache go straight to memory */
    const bool stream = (size_t)rows * row_bytes >= KVC_STREAM_BYTES;

    /* the distinct sequences of the ubatch (tokens interleave) and their tokens' windows */
    kvc_mask_seq seq[KVC_MAX_SEQ];
    uint64_t seqs = 0;
    for (uint32_t t = 0; t < n_tokens; t++) {
        const uint32_t s = (uint32_t)ub->seq_ids[ub->seq_off[t / ub->n_seq_tokens]];
        int32_t lo, hi;
        kvc_unified_visible_range(c, ub->pos[t], causal, &lo, &hi);
        kvc_mask_seq *q = &seq[s];
        if (!(seqs >> s & 1u)) {
            seqs |= (uint64_t)1 << s;
            memset(q, 0, sizeof *q);
            q->edge_range[0] = q->edge_range[1] = lo;
            q->edge_range[2] = q->edge_range[3] = hi;
        }
        q->n_tokens++;
        int32_t *r = q->edge_range;
        r[0] = lo < r[0] ? lo : r[0];
        r[1] = lo > r[1] ? lo : r[1];
        r[2] = hi < r[2] ? hi : r[2];
        r[3] = hi > r[3] ? hi : r[3];
    }

    const unsigned n_vis = kvc_popcount64(seqs);
    int32_t *vis = kvc_malloc((size_t)(n_vis ? n_vis : 1) * (n_kv ? n_kv : 1) * sizeof *vis);
    if (!vis) {
        return KVC_E_NOMEM;
    }
    const size_t base_stride = kvc_pad_u32((uint32_t)row_bytes, 64);
    size_t n_edges = 0, n_bases = 0;
    unsigned k = 0;
    for (uint64_t m = seqs; m; m &= m - 1, k++) {
        kvc_mask_seq *q = &seq[kvc_ctz64(m)];
        const bool try_edges = !alibi && q->n_tokens >= KVC_MASK_MIN_ROWS;
        /* an empty edge range when rows are computed directly */
        const int32_t none[4] = {0, 0, 0, 0};
        q->vis = vis + (size_t)k * n_kv;
        const uint32_t n_edge = kvc_mask_key_positions(vis + (size_t)k * n_kv, cells->pos, cells->seq, n_kv,
                                                       kvc_ctz64(m), try_edges ? q->edge_range : none);
        if (try_edges && n_edge <= n_kv / KVC_MASK_EDGE_DIV) {
            q->n_edge = n_edge;
            q->use_edges = true;
            n_edges += n_edge;
            n_bases++;
        }
    }

    uint8_t *scratch = NULL;
    if (n_bases) {
        scratch = kvc_malloc(n_bases * base_stride + n_edges * sizeof(uint32_t));
        if (!scratch) {
            kvc_free(vis);
            return KVC_E_NOMEM;
        }
        uint8_t *next_base = scratch;
        uint32_t *next_edge = (uint32_t *)(scratch + n_bases * base_stride);
        for (uint64_t m = seqs; m; m &= m - 1) {
            kvc_mask_seq *q = &seq[kvc_ctz64(m)];
            if (!q->use_edges) {
                continue;
            }
            q->base = next_base;
            next_base += base_stride;
            kvc_mask_row(q->base, dtype, q->vis, n_kv, q->edge_range[1], q->edge_range[2], 0, false, false);
            q->edge = next_edge;
            next_edge += kvc_mask_edges(q->edge, q->vis, n_kv, q->edge_range);
        }
    }

    for (uint32_t t = 0; t < n_tokens; t++) {
        const kvc_mask_seq *q = &seq[ub->seq_ids[ub->seq_off[t / ub->n_seq_tokens]]];
        const int32_t p1 = ub->pos[t];
        int32_t lo, hi;
        kvc_unified_visible_range(c, p1, causal, &lo, &hi);
        uint8_t *row = (uint8_t *)out + (size_t)t * row_bytes;
        if (!q->use_edges) {
            kvc_mask_row(row, dtype, q->vis, n_kv, lo, hi, p1, alibi, stream);
            continue;
        }
        /* the token's edge cells are shown in the base row for the copy, then hidden again */
        for (uint32_t e = 0; e < q->n_edge; e++) {
            const int32_t v = q->vis[q->edge[e]];
            if (v >= lo && v <= hi) {
                kvc_mask_set(q->base, dtype, q->edge[e], true);
            }
        }
        kvc_copy(row, q->base, row_bytes, stream);
        for (uint32_t e = 0; e < q->n_edge; e++) {
            kvc_mask_set(q->base, dtype, q->edge[e], false);
        }
    }
    kvc_free(scratch);
    kvc_free(vis);

    /* padding rows see nothing */
    if (rows > n_tokens && n_kv) {
        kvc_mask_fill_hidden((uint8_t *)out + (size_t)n_tokens * row_bytes, dtype, (size_t)(rows - n_tokens) * n_kv, stream);
    }
    if (stream) {
        kvc_stream_fence();
    }
    return KVC_OK;
}

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

/* --- defragmentation ------------------------------------------------------------------- */

void kvc_unified_defrag_sched(kvc_unified *c, float thold) {
    /* small contexts are not worth it; the padding counts as used */
    const float frag = c->n >= 2048 ? 1.0f - ((float)(c->cells.used + c->n_pad) / (float)c->n) : 0.0f;
    if ((frag > 0.0f ? frag : 0.0f) > thold) {
        c->do_defrag = true;
    }
}

int kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes) {
    kvc_cells *cells = &c->cells;
    const uint32_t n_layer = c->n_layer;
    const uint32_t n_kv = cells->used_max_p1;
    const uint32_t n_used = cells->used;
    uint32_t *ids = c->defrag_ids;
    /* each move costs 6 graph nodes per layer; unsigned arithmetic as the seed (a budget below
     * 2*n_layer wraps around to "unlimited") */
    const uint32_t max_moves = n_layer ? ((uint32_t)n_max_nodes - 2 * n_layer) / (6 * n_layer) : 0;
    uint32_t n_moves = 0;
    /* every cell at or above `top` is empty or already moved */
    uint32_t top = n_kv;

    for (uint32_t i = 0; i < n_kv; i++) {
        ids[i] = n_kv;
    }
    c->n_defrag_ids = n_kv;

    for (uint32_t i0 = 0; i0 < n_used; i0++) {
        if (!kvc_cells_is_empty(cells, i0)) {
            ids[i0] = i0;
            continue;
        }
        /* a hole: fill it with the last cells of the cache */
        uint32_t nh = 1;
        while (i0 + nh < n_used && kvc_cells_is_empty(cells, i0 + nh)) {
            nh++;
        }
        uint32_t nf = 0;
        uint32_t is = top - 1;
        for (; is > i0; is--) {
            if (kvc_cells_is_empty(cells, is) || ids[is] != n_kv) {
                continue;
            }
            if (++nf == nh) {
                break;
            }
        }
        if (nf != nh) {
            return KVC_E_INTERNAL; /* the used count disagrees with the cells */
        }
        top = is;

        nf = 0;
        bool cont = false, stop = false;
        for (uint32_t i1 = is; i1 < n_kv; i1++) {
            if (kvc_cells_is_empty(cells, i1) || ids[i1] != n_kv) {
                if (n_moves == max_moves) {
                    stop = true;
                    break;
                }
                cont = false;
                continue;
            }
            ids[i1] = i0 + nf;
            kvc_cells_mv(cells, i1, i0 + nf);
            c->head = n_used;
            if (!cont) {
                n_moves++;
                cont = true;
            }
            if (++nf == nh) {
                break;
            }
        }
        if (stop || n_moves == max_moves) {
            break;
        }
        i0 += nh - 1;
    }
    return n_moves > 0;
}

/* The next run of the plan at or after *i: cells [src, src + nm) move to [dst, dst + nm).
 * Returns false when no move is left. */
static bool kvc_defrag_next_run(const uint32_t *ids, uint32_t n_ids, uint32_t *i, uint32_t *src,
                                uint32_t *dst, uint32_t *nm) {
    for (uint32_t k = *i; k < n_ids; k++) {
        const uint32_t id = ids[k];
        if (id == k || id == n_ids) {
            continue;
        }
        uint32_t m = 1;
        while (k + m < n_ids && ids[k + m] == id + m) {
            m++;
        }
        *src = k;
        *dst = id;
        *nm = m;
        *i = k + m;
        return true;
    }
    *i = n_ids;
    return false;
}

uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs) {
    uint32_t i = 0, src, dst, nm, n = 0;
    while (kvc_defrag_next_run(c->defrag_ids, c->n_defrag_ids, &i, &src, &dst, &nm)) {
        if (runs) {
            runs[3 * n] = src;
            runs[3 * n + 1] = dst;
            runs[3 * n + 2] = nm;
        }
        n++;
    }
    return n;
}

/* Whether no cell is both a source and a destination of the runs: the moves can then be
 * made in any order, layer by layer and without overlap. */
static bool kvc_runs_disjoint(const uint32_t *runs, uint32_t n_runs, uint32_t size) {
    uint64_t *dst = kvc_calloc(((size_t)size + 63) / 64, sizeof *dst);
    if (!dst) {
        return false;
    }
    for (uint32_t q = 0; q < n_runs; q++) {
        for (uint32_t m = 0; m < runs[3 * q + 2]; m++) {
            const uint32_t i = runs[3 * q + 1] + m;
            dst[i / 64] |= (uint64_t)1 << (i % 64);
        }
    }
    bool disjoint = true;
    for (uint32_t q = 0; q < n_runs && disjoint; q++) {
        for (uint32_t m = 0; m < runs[3 * q + 2]; m++) {
            const uint32_t i = runs[3 * q] + m;
            disjoint = disjoint && !(dst[i / 64] >> (i % 64) & 1u);
        }
    }
    kvc_free(dst);
    return disjoint;
}

/* The moves of layers [l0, l1) of a plan whose runs are independent. */
typedef struct kvc_move_job {
    const kvc_unified *c;
    uint32_t           l0, l1;
    const uint32_t    *runs;
    uint32_t           n_runs;
    const kvc_cols    *cols;    /* the moved cells as columns of a transposed V (2- or 4-byte
                                 * elements), NULL otherwise */
    bool               stream;
} kvc_move_job;

static void kvc_move_layers(void *arg) {
    const kvc_move_job *j = arg;
    const kvc_unified *c = j->c;
    const uint32_t *runs = j->runs;
    const uint32_t n_runs = j->n_runs;
    const bool stream = j->stream;
    const size_t size = c->cells.size;
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t l = j->l0; l < j->l1; l++) {
        const kvc_layer *ly = &c->layers[l];
        for (uint32_t q = 0; ly->k && q < n_runs; q++) {
            const uint32_t *u = runs + 3 * q;
            kvc_copy(ly->k + u[1] * ly->k_row_bytes, ly->k + u[0] * ly->k_row_bytes, u[2] * ly->k_row_bytes, stream);
        }
        if (!ly->v) {
            continue;
        }
        if (!c->v_trans) {
            for (uint32_t q = 0; q < n_runs; q++) {
                const uint32_t *u = runs + 3 * q;
                kvc_copy(ly->v + u[1] * ly->v_row_bytes, ly->v + u[0] * ly->v_row_bytes, u[2] * ly->v_row_bytes, stream);
            }
        } else if (j->cols) {
            kvc_cols_apply(j->cols, ly->v, size * el, ly->n_embd_v);
        } else {
            for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                uint8_t *row = ly->v + (size_t)e * size * el;
                for (uint32_t q = 0; q < n_runs; q++) {
                    const uint32_t *u = runs + 3 * q;
                    memcpy(row + (size_t)u[1] * el, row + (size_t)u[0] * el, u[2] * el);
                }
            }
        }
    }
    if (stream) {
        kvc_stream_fence();   /* this thread's non-temporal stores, before it reports done */
    }
}

void kvc_unified_defrag_move(kvc_unified *c) {
    const size_t size = c->cells.size;
    const size_t el = kvc_type_get(c->type_v)->type_size;
    const uint32_t n_runs = kvc_unified_defrag_runs(c, NULL);
    uint32_t n_moved = 0;
    size_t row_bytes = 0; /* K and V rows of one cell over all layers (V: rows layout only) */
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        row_bytes += (ly->k ? ly->k_row_bytes : 0) + (ly->v && !c->v_trans ? ly->v_row_bytes : 0);
    }
    /* a transposed V of 2- or 4-byte elements moves as columns (kvc_cols), from a pair list */
    const bool by_cols = c->v_trans && (el == 2 || el == 4);
    uint32_t *runs = NULL, *pairs = NULL;
    if (n_runs) {
        runs = kvc_malloc((size_t)n_runs * 3 * sizeof *runs);
    }
    if (runs) {
        kvc_unified_defrag_runs(c, runs);
        for (uint32_t q = 0; q < n_runs; q++) {
            n_moved += runs[3 * q + 2];
        }
        if (by_cols) {
            pairs = kvc_malloc((size_t)n_moved * 2 * sizeof *pairs);
        }
    }

    if (runs && (pairs || !by_cols) && kvc_runs_disjoint(runs, n_runs, c->cells.size)) {
        /* moves larger than the caches write their destinations straight to memory */
        const bool stream = (size_t)n_moved * row_bytes >= KVC_STREAM_BYTES;
        for (uint32_t q = 0, k = 0; pairs && q < n_runs; q++) {
            for (uint32_t m = 0; m < runs[3 * q + 2]; m++, k++) {
                pairs[2 * k] = runs[3 * q + 1] + m;
                pairs[2 * k + 1] = runs[3 * q] + m;
            }
        }
        /* layer by layer, so that each buffer is streamed through once; a large move is
         * shared among threads by layers (scattered copies are bound by how many reads are in
         * flight, and each core adds its own) */
        const unsigned n_jobs = stream ? kvc_min_u32(kvc_parallel_width(), c->n_layer) : 1;
        kvc_cols cols;
        kvc_cols_init(&cols, pairs, by_cols ? n_moved : 0, c->cells.size, (uint32_t)el);
        kvc_move_job jobs[KVC_MAX_THREADS];
        for (unsigned t = 0; t < n_jobs; t++) {
            jobs[t] = (kvc_move_job){ c, (uint32_t)((uint64_t)c->n_layer * t / n_jobs),
                                      (uint32_t)((uint64_t)c->n_layer * (t + 1) / n_jobs),
                                      runs, n_runs, by_cols ? &cols : NULL, stream };
        }
        kvc_parallel(kvc_move_layers, jobs, sizeof jobs[0], n_jobs);
        kvc_cols_free(&cols);
    } else if (n_runs) {
        /* no memory for the run list (or a plan that refills cells it empties): the moves
         * one run at a time, in the order of their sources */
        uint32_t i = 0, src, dst, nm;
        while (kvc_defrag_next_run(c->defrag_ids, c->n_defrag_ids, &i, &src, &dst, &nm)) {
            for (uint32_t l = 0; l < c->n_layer; l++) {
                const kvc_layer *ly = &c->layers[l];
                if (ly->k) {
                    memmove(ly->k + dst * ly->k_row_bytes, ly->k + src * ly->k_row_bytes, nm * ly->k_row_bytes);
                }
                if (!ly->v) {
                    continue;
                }
                if (!c->v_trans) {
                    memmove(ly->v + dst * ly->v_row_bytes, ly->v + src * ly->v_row_bytes, nm * ly->v_row_bytes);
                } else {
                    for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                        uint8_t *row = ly->v + (size_t)e * size * el;
                        memmove(row + (size_t)dst * el, row + (size_t)src * el, nm * el);
                    }
                }
            }
        }
    }
    kvc_free(pairs);
    kvc_free(runs);
    c->do_defrag = false;
}

/* --- snapshots ------------------------------------------------------------------------- */

int kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s) {
    memset(s, 0, sizeof *s);
    if (kvc_cells_init(&s->cells, c->cells.size, c->cells.n_seq_max) != KVC_OK) {
        return KVC_E_NOMEM;
    }
    kvc_cells_copy(&s->cells, &c->cells);
    s->rec = kvc_malloc((c->n_rec ? c->n_rec : 1) * sizeof *s->rec);
    s->rec_pos = kvc_malloc((c->n_rec_arena ? c->n_rec_arena : 1) * sizeof *s->rec_pos);
    s->rec_seq = kvc_malloc((c->n_rec_arena ? c->n_rec_arena : 1) * sizeof *s->rec_seq);
    if (!s->rec || !s->rec_pos || !s->rec_seq) {
        kvc_unified_snapshot_free(s);
        return KVC_E_NOMEM;
    }
    memcpy(s->rec, c->rec, c->n_rec * sizeof *s->rec);
    memcpy(s->rec_pos, c->rec_pos, c->n_rec_arena * sizeof *s->rec_pos);
    memcpy(s->rec_seq, c->rec_seq, c->n_rec_arena * sizeof *s->rec_seq);
    s->n_rec = c->n_rec;
    s->n_rec_arena = c->n_rec_arena;
    s->head = c->head;
    s->n = c->n;
    s->do_defrag = c->do_defrag;
    return KVC_OK;
}

void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s) {
    /* the cache's own arrays are at least as large as the snapshot's (they only grow) */
    kvc_cells_copy(&c->cells, &s->cells);
    memcpy(c->rec, s->rec, s->n_rec * sizeof *s->rec);
    memcpy(c->rec_pos, s->rec_pos, s->n_rec_arena * sizeof *s->rec_pos);
    memcpy(c->rec_seq, s->rec_seq, s->n_rec_arena * sizeof *s->rec_seq);
    c->n_rec = s->n_rec;
    c->n_rec_arena = s->n_rec_arena;
    c->head = s->head;
    c->n = s->n;
    c->do_defrag = s->do_defrag;
}

void kvc_unified_snapshot_free(kvc_unified_snapshot *s) {
    kvc_cells_free(&s->cells);
    kvc_free(s->rec);
    kvc_free(s->rec_pos);
    kvc_free(s->rec_seq);
    memset(s, 0, sizeof *s);
}
