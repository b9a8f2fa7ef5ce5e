/* kvcache — the plan of a state read and what the readers share (see kvc_state_plan.h). */
#include "kvc_state_plan.h"

#include "kvc_slot.h"

#include <inttypes.h>
#include <string.h>

void kvc_state_plan_free(kvc_state_plan *plan) {
    kvc_state_sec *secs = plan->many ? plan->many : &plan->one;
    for (uint32_t k = 0; k < plan->n_sec; k++) {
        kvc_free(secs[k].pos);
        kvc_free(secs[k].seq);
        kvc_free(secs[k].ext);
    }
    kvc_free(plan->many);
    memset(plan, 0, sizeof *plan);
}

/* The cache as the section parser holds a state to it (every stream has one geometry: ref names
 * stream 0, and must outlive d). */
static void state_dest(const kvc_state_stream *ref, int32_t seq_id, unsigned flags, unsigned layout,
                       kvc_sec_dest *d) {
    const kvc_unified *c = ref->c;
    memset(d, 0, sizeof *d);
    d->ext_bytes = kvc_unified_has_ext(c) ? kvc_layout_ext_bytes(layout) : 0;
    d->seq_id = seq_id;
    d->size = c->cells.size;
    d->single_n_ids = 1;
    d->n_seq_max = c->n_seq_max;
    d->seq_words = c->cells.seq_words;
    d->ids_once = c->ops->ids_once;
    d->type_k = c->type_k;
    d->type_v = c->type_v;
    d->v_trans = c->v_trans;
    d->convert_v = (flags & KVC_STATE_CONVERT_V) != 0;
    d->can_convert_v = true;
    d->n_layer = c->n_layer;
    d->cache = ref;
    d->layer = kvc_state_stream_layer;
}

/* The framing and a section per stream (one in a layout without stream counts), each against a
 * stream of the cache (a single sequence's against its stream); an empty stream's section has no
 * cells to read (a whole-cache read has cleared the cache: llama.cpp clears once, before the
 * sections). On failure the caller frees the plan. */
static int parse_secs(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                      unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    kvc_cursor r = { data, data ? len : 0, 0 };
    const kvc_state_stream ref = { c, 0 };
    kvc_sec_dest d;
    kvc_frame f;
    int rc;
    plan->data = data;
    plan->seq_id = seq_id;
    state_dest(&ref, seq_id, flags, layout, &d);
    if ((rc = kvc_frame_begin(&r, layout, kvc_unified_n_stream(c), &f, err)) != KVC_OK) {
        return rc;
    }
    kvc_state_sec *secs = &plan->one;
    if (f.n_stream > 1) {
        secs = plan->many = kvc_calloc(f.n_stream, sizeof *plan->many);
        if (!secs) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory reading %" PRIu32 " streams", f.n_stream);
        }
    }
    for (uint32_t s = 0; s < f.n_stream; s++) {
        const size_t at = r.off;
        if (kvc_frame_take_empty(&r, &f)) {
            continue;
        }
        kvc_section ps;
        memset(&ps, 0, sizeof ps);
        rc = kvc_sec_parse(&r, &d, &ps, err);
        kvc_state_sec *sec = &secs[plan->n_sec++];
        sec->stream = seq_id < 0 ? s : kvc_unified_stream_of(c, seq_id);
        sec->cell_count = ps.cell_count;
        sec->data_off = ps.data_off;
        sec->v_trans = ps.v_trans;
        sec->pos = ps.pos; /* owned by the plan from here */
        sec->seq = ps.seq;
        sec->ext = ps.ext;
        if (rc != KVC_OK) {
            if (f.n_stream > 1) {
                kvc_err_wrap(err, rc, "stream %" PRIu32 " (from byte %zu)", s, at);
            }
            return rc;
        }
    }
    plan->len = r.off;
    /* a single sequence's state of empty sections only keeps the destination's cells */
    plan->noop = seq_id >= 0 && plan->n_sec == 0;
    return KVC_OK;
}

int kvc_state_plan_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_room_fn *room, kvc_state_plan *plan, kvc_err *err) {
    int rc = parse_secs(c, seq_id, data, len, flags, layout, plan, err);
    plan->room = room;
    if (rc == KVC_OK && !(flags & KVC_STATE_NO_ROOM)) {
        rc = kvc_state_plan_room(c, plan, err);
    }
    if (rc != KVC_OK) {
        kvc_state_plan_free(plan);
    }
    return rc;
}

/* kvc_state_plan_room, asking without evicting (KVC_ROOM_EVICTING) unless evict. */
static int plan_room(kvc_unified *c, const kvc_state_plan *plan, bool evict, kvc_err *err) {
    return plan->room && plan->seq_id >= 0 && plan->n_sec > 0 ? plan->room(c, plan, evict, err) : KVC_OK;
}

int kvc_state_plan_room(kvc_unified *c, const kvc_state_plan *plan, kvc_err *err) {
    return plan_room(c, plan, true, err);
}

typedef struct parts_room_ctx {
    kvc_unified *const   *cs;
    const kvc_state_plan *plans;
    kvc_err              *err;
} parts_room_ctx;

static int part_room(void *ctx, uint32_t k, bool evict) {
    const parts_room_ctx *p = ctx;
    return plan_room(p->cs[k], &p->plans[k], evict, p->err);
}

int kvc_state_plan_room_parts(kvc_unified *const *cs, const kvc_state_plan *plans, uint32_t n, uint32_t *failed,
                              kvc_err *err) {
    parts_room_ctx ctx = { cs, plans, err };
    return kvc_parts_room(n, part_room, &ctx, failed);
}

/* Scatter cc cells of V given as n_embd_v rows of cc elements (a transposed blob) into rows of
 * the cache (row of cell i at dst + i, or at cells[i] when cells is not NULL), or gather the
 * reverse: rows of the blob into the cache's transposed V. el is 2 or 4 for every type a
 * transposed V can have; memcpy of a constant size compiles to a plain load and store. */
void kvc_state_v_transpose_in(uint8_t *v, size_t row, const uint8_t *src, uint32_t cc, uint32_t width, size_t el,
                           uint32_t dst, const int32_t *cells) {
    if (cells) {
        for (uint32_t i = 0; i < cc; i++) {
            uint8_t *d = v + (size_t)cells[i] * row;
            for (uint32_t j = 0; j < width; j++) {
                memcpy(d + (size_t)j * el, src + ((size_t)j * cc + i) * el, el);
            }
        }
        return;
    }
    for (uint32_t j = 0; j < width; j++) {
        const uint8_t *s = src + (size_t)j * cc * el;
        uint8_t *d = v + (size_t)dst * row + (size_t)j * el;
        if (el == 2) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * 2, 2);
            }
        } else if (el == 4) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * 4, 4);
            }
        } else {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * row, s + (size_t)i * el, el);
            }
        }
    }
}

void kvc_state_v_untranspose_in(uint8_t *v, uint32_t size, const uint8_t *src, size_t row, uint32_t cc,
                             uint32_t width, size_t el, uint32_t dst, const int32_t *cells) {
    if (cells) {
        for (uint32_t j = 0; j < width; j++) {
            uint8_t *d = v + (size_t)j * size * el;
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)cells[i] * el, src + (size_t)i * row + (size_t)j * el, el);
            }
        }
        return;
    }
    for (uint32_t j = 0; j < width; j++) {
        uint8_t *d = v + ((size_t)j * size + dst) * el;
        const uint8_t *s = src + (size_t)j * el;
        if (el == 2) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * 2, s + (size_t)i * row, 2);
            }
        } else if (el == 4) {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * 4, s + (size_t)i * row, 4);
            }
        } else {
            for (uint32_t i = 0; i < cc; i++) {
                memcpy(d + (size_t)i * el, s + (size_t)i * row, el);
            }
        }
    }
}

/* Whether a read copies the K/V data of cc cells with non-temporal stores: from KVC_STREAM_BYTES
 * on (data that does not stay in the caches anyway). */
bool kvc_state_stream_data(const kvc_unified *c, uint32_t cc) {
    uint64_t n = 0;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        n += (uint64_t)cc * (c->layers[il].k_row_bytes + c->layers[il].v_row_bytes);
    }
    return n >= KVC_STREAM_BYTES;
}

/* n_rows transposed V rows of cc elements el, src's one after the other, into rows of `size`
 * elements from element dst (one copy when the rows are the whole buffer). */
void kvc_state_v_rows_in(uint8_t *v, uint32_t size, const uint8_t *src, uint32_t cc, uint32_t n_rows, size_t el,
                      uint32_t dst, bool stream) {
    if (cc == size && dst == 0) {
        kvc_copy(v, src, (size_t)n_rows * cc * el, stream);
        return;
    }
    for (uint32_t j = 0; j < n_rows; j++) {
        kvc_copy(v + ((size_t)j * size + dst) * el, src + (size_t)j * cc * el, (size_t)cc * el, stream);
    }
}
