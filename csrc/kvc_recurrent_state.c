/* kvcache — the recurrent cache's state codec: the bytes of a whole cache's or a sequence's state
 * (docs/format.md, "A section"), written through the shared state writer and read through the
 * section parser, all or nothing (see kvc_recurrent.h). */
#include "kvc_recurrent.h"
#include "kvc_section.h"
#include "kvc_state.h"

#include <string.h>

static void rec_layer(const void *cache, uint32_t il, kvc_layer *out) {
    *out = ((const kvc_recurrent *)cache)->layers[il];
}

/* The cache as the shared state writer sees it: a cell is listed when it holds a sequence; a
 * single-sequence state carries no ids (the reader gives it its own); V is never transposed. */
/* The plane holding cell i's current state: a pending rollback's (of the written sequence, or for
 * the whole cache of the cell's first sequence, the one s_copy reads). */
static uint32_t rec_plane(const kvc_state_src *s, uint32_t i) {
    const kvc_rec_cells *t = &((const kvc_recurrent *)s->cache)->cells;
    const int32_t q = s->seq_id >= 0 ? s->seq_id : kvc_seqs_next(t->seq, t->size, t->seq_words, i, -1);
    return q >= 0 ? t->rs_idx[q] : 0;
}

static void rec_src(const kvc_recurrent *c, int32_t seq_id, kvc_state_src *s) {
    s->swa = NULL;
    s->swa_pmax = -1;
    s->size = c->cells.size;
    s->pos = c->cells.pos;
    s->seq = c->cells.seq;
    s->cells = NULL;
    s->seq_words = c->cells.seq_words;
    s->seq_id = seq_id;
    s->empty_is_no_seq = true;
    s->single_writes_id = false;
    s->type_k = c->type_k;
    s->type_v = c->type_v;
    s->v_trans = false;
    s->v_el = 0;
    s->n_layer = c->n_layer;
    s->n_layer_field = c->n_layer_model;
    s->cache = c;
    s->layer = rec_layer;
    s->ext = NULL;          /* a recurrent memory's cells have no extension */
    s->ext_bytes = 0;
    s->plane = c->n_rs_seq ? rec_plane : NULL;
}

/* The memory state of a recurrent cache has no stream count in any layout (llama.cpp's recurrent
 * memory kept the seed's shape); of a layout only the sequence-blob prefix applies. */
static void rec_framed(const kvc_recurrent *c, int32_t seq_id, unsigned layout, kvc_state_src *src,
                       kvc_state_framed *f) {
    rec_src(c, seq_id, src);
    f->layout = layout & KVC_LAYOUT_FRESH_OUT;
    f->seq_id = seq_id;
    f->prefix = seq_id >= 0 && (layout & KVC_LAYOUT_PREFIX);
    f->n_stream = 1;
    f->streams = src;
}

size_t kvc_recurrent_state_size_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout) {
    kvc_state_src s;
    kvc_state_framed f;
    rec_framed(c, seq_id, layout, &s, &f);
    return kvc_state_framed_size(&f);
}

size_t kvc_recurrent_state_size(const kvc_recurrent *c, int32_t seq_id) {
    return kvc_recurrent_state_size_lay(c, seq_id, 0);
}

int kvc_recurrent_state_write_range_lay(const kvc_recurrent *c, int32_t seq_id, unsigned layout, uint64_t offset,
                                        uint8_t *out, size_t cap, size_t *written) {
    kvc_state_src s;
    kvc_state_framed f;
    *written = 0;
    rec_framed(c, seq_id, layout, &s, &f);
    const uint64_t total = kvc_state_framed_size(&f);
    if (offset >= total || cap == 0) {
        return KVC_OK;
    }
    return kvc_state_framed_write(&f, offset, out, total - offset < cap ? (size_t)(total - offset) : cap, written);
}

int kvc_recurrent_state_write_range(const kvc_recurrent *c, int32_t seq_id, uint64_t offset, uint8_t *out,
                                    size_t cap, size_t *written) {
    return kvc_recurrent_state_write_range_lay(c, seq_id, 0, offset, out, cap, written);
}

int kvc_recurrent_state_write(const kvc_recurrent *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written) {
    kvc_state_src s;
    rec_src(c, seq_id, &s);
    const size_t need = kvc_state_src_size(&s);
    if (cap < need) {
        return KVC_E_NOSPACE;
    }
    return kvc_state_src_write(&s, 0, out, need, written);
}

/* The cache as the section parser holds a state to it: a whole cache's cells list their ids,
 * each sequence in one cell; a sequence's state is at most one cell, listing no id; V is never
 * transposed. */
static void rec_dest(const kvc_recurrent *c, int32_t seq_id, kvc_sec_dest *d) {
    memset(d, 0, sizeof *d);
    d->seq_id = seq_id;
    d->size = c->cells.size;
    d->seq_cells_max = 1;
    d->single_n_ids = 0;
    d->n_seq_max = c->n_seq_max;
    d->seq_words = c->cells.seq_words;
    d->seq_in_one_cell = true;
    d->type_k = c->type_k;
    d->type_v = c->type_v;
    d->v_trans = false;
    d->n_layer = c->n_layer;
    d->n_layer_field = c->n_layer_model;
    d->cache = c;
    d->layer = rec_layer;
}

/* Where the parser puts the cells: a whole cache's straight into c->work, wiped (its tails are
 * the cell that lists each sequence), a sequence's one position into *pos1. */
static void rec_dest_into(kvc_recurrent *c, int32_t seq_id, int32_t *pos1, kvc_sec_dest *d) {
    kvc_rec_cells *w = &c->work;
    if (seq_id >= 0) {
        d->into_pos = pos1;
        return;
    }
    kvc_rec_cells_wipe(w);
    d->into_pos = w->pos;
    d->into_seq = w->seq;
    d->into_cell_of = w->tail;
}

/* Complete c->work from a validated section (a whole cache's cells are in it already; a
 * sequence's cell is placed in a copy of the live table). The live table is not touched. */
static int place_cells(kvc_recurrent *c, int32_t seq_id, uint32_t cc, int32_t pos, kvc_err *err) {
    kvc_rec_cells *w = &c->work;
    if (seq_id == -1) {
        w->n = c->cells.n; /* clear() keeps n, and today's the staged sources and the zero row */
        w->rs_z = c->cells.rs_z;
        memcpy(w->src0, c->cells.src0, (size_t)w->size * sizeof *w->src0);
        for (uint32_t i = 0; i < cc; i++) {
            w->src[i] = (int32_t)i; /* the restored states are kept as they are */
        }
        w->head = 0;
        w->used = cc;
        return KVC_OK;
    }
    kvc_rec_cells_copy(w, &c->cells);
    kvc_recurrent_table_seq_rm(c, w, seq_id, -1, -1);
    if (cc == 0) {
        return KVC_OK; /* the sequence is just removed */
    }
    return kvc_recurrent_place_one(c, w, seq_id, pos, err);
}

int kvc_recurrent_state_read(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                             size_t *consumed, kvc_err *err) {
    return kvc_recurrent_state_read_ex(c, seq_id, data, len, 0, consumed, err);
}

int kvc_recurrent_state_read_lay(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len,
                                 unsigned flags, unsigned layout, size_t *consumed, kvc_err *err) {
    size_t base = 0;
    *consumed = 0;
    /* the prefix is the one mark of a layout in a recurrent state: DETECT reads it when it is there */
    if (layout & (KVC_LAYOUT_PREFIX | KVC_LAYOUT_DETECT)) {
        const int rc = kvc_state_prefix_take(data, len, seq_id, &base, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    if (!base) {
        return kvc_recurrent_state_read_ex(c, seq_id, data, len, flags, consumed, err);
    }
    int rc = kvc_recurrent_state_read_ex(c, seq_id, data + base, len - base, flags, consumed, err);
    if (rc != KVC_OK) {
        kvc_err_wrap(err, rc, "memory state (from byte %zu)", base);
    } else {
        *consumed += base;
    }
    return rc;
}

int kvc_recurrent_state_prepare(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                kvc_state_plan *plan, kvc_err *err) {
    memset(plan, 0, sizeof *plan);
    if (seq_id < -1 || (seq_id >= 0 && (uint32_t)seq_id >= c->n_seq_max)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %d is outside [0, %u) and not -1", seq_id, c->n_seq_max);
    }
    kvc_cursor r = { data, data ? len : 0, 0 };
    kvc_sec_dest d;
    kvc_section sec;
    int32_t pos1 = 0;
    memset(&sec, 0, sizeof sec);
    rec_dest(c, seq_id, &d);
    c->can_unplace = false;   /* the work table is where the read builds its cells */
    rec_dest_into(c, seq_id, &pos1, &d);
    int rc = kvc_sec_parse(&r, &d, &sec, err);
    if (rc == KVC_OK && (flags & KVC_STATE_EXACT)) {
        rc = kvc_state_check_end(r.off, r.len, err);
    }
    if (rc == KVC_OK) {
        rc = place_cells(c, seq_id, sec.cell_count, pos1, err);
    }
    if (rc == KVC_OK) {
        /* one section, whose cells the parse put in the work table (no positions in the plan) */
        plan->data = data;
        plan->seq_id = seq_id;
        plan->len = r.off;
        plan->n_sec = 1;
        plan->one.cell_count = sec.cell_count;
        plan->one.data_off = sec.data_off;
    }
    kvc_sec_free(&sec);
    return rc;
}

void kvc_recurrent_state_apply(kvc_recurrent *c, const kvc_state_plan *plan) {
    /* the K/V data follow the V layout flag and the layer count, each after a 12-byte header */
    kvc_recurrent_swap_work(c);
    c->can_unplace = false;
    if (plan->seq_id == -1) {
        kvc_recurrent_zero_data(c);
    }
    const kvc_state_sec *sec = kvc_state_plan_secs(plan);
    const size_t head = c->cells.head, cc = sec->cell_count;
    const uint8_t *p = plan->data + sec->data_off + 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (cc && L->k) {
            memcpy(L->k + head * L->k_row_bytes, p + 12, cc * L->k_row_bytes);
        }
        p += 12 + cc * L->k_row_bytes;
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (cc && L->v) {
            memcpy(L->v + head * L->v_row_bytes, p + 12, cc * L->v_row_bytes);
        }
        p += 12 + cc * L->v_row_bytes;
    }
}

uint32_t kvc_recurrent_seq_rows(const kvc_recurrent *c, int32_t seq_id, const uint8_t **rows, uint64_t *offs,
                                uint64_t *lens) {
    const int32_t cell = c->cells.tail[seq_id];
    if (cell < 0) {
        return 0;
    }
    /* the state's data section ends it: the V layout flag and the layer count, then each row after
     * a 12-byte header (type, row size), as kvc_recurrent_state_apply reads it */
    uint64_t data = 8;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        data += 24 + (uint64_t)c->layers[il].k_row_bytes + c->layers[il].v_row_bytes;
    }
    uint64_t off = kvc_recurrent_state_size_lay(c, seq_id, 0) - data + 8;
    /* the plane a pending rollback of the sequence reads (the one the state is written from) */
    const size_t row = (size_t)(c->n_rs_seq ? c->cells.rs_idx[seq_id] : 0) * c->cells.size + (size_t)cell;
    for (uint32_t k = 0; k < 2 * c->n_layer; k++) {
        const kvc_layer *L = &c->layers[k % c->n_layer];
        const bool is_k = k < c->n_layer;
        const size_t n = is_k ? L->k_row_bytes : L->v_row_bytes;
        const uint8_t *base = is_k ? L->k : L->v;
        rows[k] = base ? base + row * n : NULL;
        offs[k] = off + 12;
        lens[k] = n;
        off += 12 + n;
    }
    return 1;
}

int kvc_recurrent_state_read_ex(kvc_recurrent *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                size_t *consumed, kvc_err *err) {
    kvc_state_plan plan;
    *consumed = 0;
    const int rc = kvc_recurrent_state_prepare(c, seq_id, data, len, flags, &plan, err);
    if (rc != KVC_OK) {
        return rc;
    }
    kvc_recurrent_state_apply(c, &plan);
    *consumed = plan.len;
    return KVC_OK;
}
