#include "kvc_hybrid_state.h"

#include "kvc_layout.h"
#include "kvc_state.h"

#include <inttypes.h>
#include <string.h>

int kvc_hybrid_state_init(kvc_hybrid *h, uint32_t n_layer, const uint32_t *recurrent_il, kvc_err *err) {
    return kvc_recurrent_set_model_layers(h->recr, n_layer, recurrent_il, err);
}

/* data + off, without arithmetic on a NULL pointer (an empty input) */
static const uint8_t *bytes_at(const uint8_t *data, size_t off) {
    return data ? data + off : NULL;
}

static bool hybrid_seq_valid(const kvc_hybrid *h, int32_t seq_id) {
    return seq_id >= -1 && (seq_id < 0 || (uint32_t)seq_id < h->attn->n_seq_max);
}

/* The recurrent part's layout: the prefix, when written, is in front of the first part written. */
static unsigned recr_layout(unsigned layout, unsigned parts) {
    return (parts & KVC_HYBRID_PARTIAL_ONLY) ? layout : layout & ~(unsigned)KVC_LAYOUT_PREFIX;
}

static size_t attn_bytes(const kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts) {
    return (parts & KVC_HYBRID_PARTIAL_ONLY) ? 0 : kvc_unified_state_size_lay(h->attn, seq_id, layout);
}

size_t kvc_hybrid_state_size(const kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts) {
    if (!hybrid_seq_valid(h, seq_id)) {
        return 0;
    }
    return attn_bytes(h, seq_id, layout, parts) + kvc_recurrent_state_size_lay(h->recr, seq_id,
                                                                                recr_layout(layout, parts));
}

int kvc_hybrid_state_write_range(kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts, uint64_t offset,
                                 uint8_t *out, size_t cap, size_t *written) {
    *written = 0;
    if (!hybrid_seq_valid(h, seq_id)) {
        return KVC_E_ARG;
    }
    /* the window [offset, offset + cap) of the two parts laid end to end */
    const uint64_t na = attn_bytes(h, seq_id, layout, parts);
    size_t done = 0;
    if (offset < na && cap) {
        size_t w = 0;
        const int rc = kvc_unified_state_write_range_lay(h->attn, seq_id, layout, offset, out, cap, &w);
        if (rc != KVC_OK) {
            return rc;
        }
        done = w;
    }
    if (done < cap) {
        size_t w = 0;
        const uint64_t at = offset + done - na; /* offset + done >= na here */
        const int rc = kvc_recurrent_state_write_range_lay(h->recr, seq_id, recr_layout(layout, parts), at,
                                                           out + done, cap - done, &w);
        if (rc != KVC_OK) {
            return rc;
        }
        done += w;
    }
    *written = done;
    return KVC_OK;
}

int kvc_hybrid_state_read(kvc_hybrid *h, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                          unsigned layout, unsigned parts, size_t *consumed, kvc_err *err) {
    *consumed = 0;
    if (!hybrid_seq_valid(h, seq_id)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %" PRId32 " out of range [-1, %" PRIu32 ")", seq_id,
                           h->attn->n_seq_max);
    }
    if (!(layout & KVC_LAYOUT_STREAMS) || (layout & KVC_LAYOUT_DETECT)) {
        return kvc_err_set(err, KVC_E_ARG, "a hybrid memory's state has stream counts (today's layout)");
    }
    if (!data) {
        len = 0;
    }
    size_t base = 0;
    int rc = kvc_state_prefix_take(data, len, seq_id, &base, err);
    if (rc != KVC_OK) {
        return rc;
    }
    const unsigned part_layout = layout & ~(unsigned)KVC_LAYOUT_PREFIX;
    /* phase 1: both parts validated while nothing changes */
    kvc_state_plan ap;
    memset(&ap, 0, sizeof ap);
    size_t off = base;
    if (!(parts & KVC_HYBRID_PARTIAL_ONLY)) {
        rc = kvc_unified_state_prepare_lay(h->attn, seq_id, bytes_at(data, base), len - base,
                                           flags & ~(unsigned)KVC_STATE_EXACT, part_layout, &ap, err);
        if (rc != KVC_OK) {
            return kvc_err_wrap(err, rc, "attention part (from byte %zu)", base);
        }
        off += ap.len;
    }
    kvc_rec_plan rp;
    rc = kvc_recurrent_state_prepare(h->recr, seq_id, bytes_at(data, off), len - off,
                                     flags & KVC_STATE_EXACT, &rp, err);
    if (rc != KVC_OK) {
        kvc_state_plan_free(&ap);
        if (off == len && rc == KVC_E_STATE) {
            return kvc_err_set(err, rc, "recurrent part (from byte %zu): missing, the state ends there", off);
        }
        return kvc_err_wrap(err, rc, "recurrent part (from byte %zu)", off);
    }
    /* phase 2: a prepared part applies without failing */
    if (!(parts & KVC_HYBRID_PARTIAL_ONLY)) {
        rc = kvc_unified_state_apply(h->attn, &ap);
        kvc_state_plan_free(&ap);
        if (rc != KVC_OK) {
            return kvc_err_set(err, rc, "attention part: the cache changed after it was prepared");
        }
    }
    kvc_recurrent_state_apply(h->recr, &rp);
    *consumed = off + rp.len;
    return KVC_OK;
}
