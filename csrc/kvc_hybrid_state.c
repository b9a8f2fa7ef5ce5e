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

/* How an error names an attention cache: "attention part", or which cache of the iSWA pair. */
static const char *attn_part_name(const kvc_hybrid *h, const kvc_unified *c) {
    if (!h->iswa) {
        return "attention part";
    }
    return c == h->iswa->base ? "attention part, base cache" : "attention part, SWA cache";
}

static bool hybrid_seq_valid(const kvc_hybrid *h, int32_t seq_id) {
    return seq_id >= -1 && (seq_id < 0 || (uint32_t)seq_id < h->attn->n_seq_max);
}

/* The attention caches whose states a state holds, in order, into out[0..2): the unified cache;
 * an iSWA pair's base, then its SWA cache (llama_kv_cache_iswa's order); none with PARTIAL_ONLY,
 * except an iSWA pair's SWA cache, which llama.cpp's iSWA pair writes whatever the flags. */
static uint32_t attn_caches(const kvc_hybrid *h, unsigned parts, kvc_unified *out[2]) {
    const bool partial = parts & KVC_HYBRID_PARTIAL_ONLY;
    uint32_t n = 0;
    if (h->iswa) {
        if (!partial) {
            out[n++] = h->iswa->base;
        }
        out[n++] = h->iswa->swa;
    } else if (!partial) {
        out[n++] = h->attn;
    }
    return n;
}

/* A part's layout: the sequence-blob prefix, when written, is in front of the first part only. */
static unsigned part_layout(unsigned layout, uint32_t k) {
    return k ? layout & ~(unsigned)KVC_LAYOUT_PREFIX : layout;
}

size_t kvc_hybrid_state_size(const kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts) {
    if (!hybrid_seq_valid(h, seq_id)) {
        return 0;
    }
    kvc_unified *cs[2];
    const uint32_t n = attn_caches(h, parts, cs);
    size_t total = 0;
    for (uint32_t k = 0; k < n; k++) {
        total += kvc_unified_state_size_lay(cs[k], seq_id, part_layout(layout, k));
    }
    return total + kvc_recurrent_state_size_lay(h->recr, seq_id, part_layout(layout, n));
}

int kvc_hybrid_state_write_range(kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts, uint64_t offset,
                                 uint8_t *out, size_t cap, size_t *written) {
    *written = 0;
    if (!hybrid_seq_valid(h, seq_id)) {
        return KVC_E_ARG;
    }
    /* the window [offset, offset + cap) of the parts laid end to end */
    kvc_unified *cs[2];
    const uint32_t n = attn_caches(h, parts, cs);
    uint64_t start = 0;    /* where the current part starts */
    size_t done = 0;
    for (uint32_t k = 0; k <= n && done < cap; k++) {
        const unsigned lay = part_layout(layout, k);
        const uint64_t len = k < n ? kvc_unified_state_size_lay(cs[k], seq_id, lay)
                                   : kvc_recurrent_state_size_lay(h->recr, seq_id, lay);
        const uint64_t at = offset + done;
        if (at < start + len) {
            size_t w = 0;
            const int rc = k < n ? kvc_unified_state_write_range_lay(cs[k], seq_id, lay, at - start, out + done,
                                                                     cap - done, &w)
                                 : kvc_recurrent_state_write_range_lay(h->recr, seq_id, lay, at - start, out + done,
                                                                       cap - done, &w);
            if (rc != KVC_OK) {
                return rc;
            }
            done += w;
        }
        start += len;
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
    const unsigned cache_layout = layout & ~(unsigned)KVC_LAYOUT_PREFIX;
    /* phase 1: every part validated while nothing changes: the bytes of every part first, then
     * the room the attention part's cells need (a search that may evict prefix-index cells, as
     * placement does: only for a state whose every byte is valid, and once each of an iSWA pair's
     * caches has room or can make it) */
    kvc_unified *cs[2];
    const uint32_t n = attn_caches(h, parts, cs);
    kvc_state_plan ap[2];
    size_t at[2];
    memset(ap, 0, sizeof ap);
    size_t off = base;
    for (uint32_t k = 0; k < n; k++) {
        at[k] = off;
        rc = kvc_unified_state_prepare_lay(cs[k], seq_id, bytes_at(data, off), len - off,
                                           (flags & ~(unsigned)KVC_STATE_EXACT) | KVC_STATE_NO_ROOM, cache_layout,
                                           &ap[k], err);
        if (rc != KVC_OK) {
            for (uint32_t j = 0; j < k; j++) {
                kvc_state_plan_free(&ap[j]);
            }
            return kvc_err_wrap(err, rc, "%s (from byte %zu)", attn_part_name(h, cs[k]), off);
        }
        off += ap[k].len;
    }
    kvc_state_plan rp;
    rc = kvc_recurrent_state_prepare(h->recr, seq_id, bytes_at(data, off), len - off,
                                     flags & KVC_STATE_EXACT, &rp, err);
    if (rc != KVC_OK) {
        for (uint32_t k = 0; k < n; k++) {
            kvc_state_plan_free(&ap[k]);
        }
        if (off == len && rc == KVC_E_STATE) {
            return kvc_err_set(err, rc, "recurrent part (from byte %zu): missing, the state ends there", off);
        }
        return kvc_err_wrap(err, rc, "recurrent part (from byte %zu)", off);
    }
    uint32_t k_bad = 0;
    rc = kvc_state_plan_room_parts(cs, ap, n, &k_bad, err);
    if (rc != KVC_OK) {
        for (uint32_t j = 0; j < n; j++) {
            kvc_state_plan_free(&ap[j]);
        }
        kvc_state_plan_free(&rp);
        return kvc_err_wrap(err, rc, "%s (from byte %zu)", attn_part_name(h, cs[k_bad]), at[k_bad]);
    }
    /* phase 2: a prepared part applies without failing */
    int bad = KVC_OK;
    for (uint32_t k = 0; k < n; k++) {
        const int r = kvc_unified_state_apply(cs[k], &ap[k]);
        kvc_state_plan_free(&ap[k]);
        if (r != KVC_OK && bad == KVC_OK) {
            bad = r;
        }
    }
    if (bad != KVC_OK) {
        return kvc_err_set(err, bad, "attention part: the cache changed after it was prepared");
    }
    kvc_recurrent_state_apply(h->recr, &rp);
    *consumed = off + rp.len;
    return KVC_OK;
}
