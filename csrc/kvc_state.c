/* kvcache — the unified cache's state reads: a part in a layout (to the reader of the cache's
 * type, kvc_unified_ops), several parts all or nothing, and the detection of a blob's layout (see kvc_state.h). */
#include "kvc_state.h"

#include "kvc_framing.h"
#include "kvc_le.h"
#include "kvc_types.h"

#include <inttypes.h>
#include <string.h>

int kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                              kvc_state_plan *plan, kvc_err *err) {
    return kvc_unified_state_prepare_lay(c, seq_id, data, len, 0, 0, plan, err);
}

int kvc_unified_state_prepare_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                 kvc_state_plan *plan, kvc_err *err) {
    return kvc_unified_state_prepare_lay(c, seq_id, data, len, flags, 0, plan, err);
}

int kvc_unified_state_prepare_lay(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                  unsigned layout, kvc_state_plan *plan, kvc_err *err) {
    memset(plan, 0, sizeof *plan);
    if (!kvc_state_seq_valid(c, seq_id)) {
        return kvc_err_set(err, KVC_E_ARG, "seq_id %" PRId32 " out of range [-1, %" PRIu32 ")", seq_id,
                           c->n_seq_max);
    }
    if (layout & KVC_LAYOUT_DETECT) {
        return kvc_err_set(err, KVC_E_ARG, "a part is prepared in a known layout (detection reads whole states)");
    }
    return c->ops->state_prepare(c, seq_id, data, len, flags, layout, plan, err);
}

int kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan) {
    if (plan->noop) {
        return KVC_OK;
    }
    return c->ops->state_apply(c, plan);
}

int kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data,
                                 size_t len, size_t *consumed, kvc_err *err) {
    return kvc_unified_state_read_parts_lay(caches, n_parts, seq_id, data, len, 0, 0, consumed, NULL, err);
}

int kvc_unified_state_read_parts_ex(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                    const uint8_t *data, size_t len, unsigned flags, size_t *consumed,
                                    kvc_err *err) {
    return kvc_unified_state_read_parts_lay(caches, n_parts, seq_id, data, len, flags, 0, consumed, NULL, err);
}

/* Phase 1 of a read: validate every part from data[base, len) (and find room for it) while nothing
 * changes. KVC_OK with plans[0, n_parts) ready and *end = where the last part ends. */
static int prepare_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data,
                         size_t len, size_t base, unsigned flags, unsigned layout, kvc_state_plan *plans,
                         size_t *end, kvc_err *err) {
    size_t off = base;
    int rc = KVC_OK;
    uint32_t k;
    size_t at[KVC_STATE_MAX_PARTS];
    /* the bytes of every part, then the room of each (a search that may evict prefix-index cells,
     * as placement does: only for a state whose every byte is valid, and once every part has room
     * or can make it) */
    for (k = 0; k < n_parts && rc == KVC_OK; k++) {
        at[k] = off;
        rc = kvc_unified_state_prepare_lay(caches[k], seq_id, off ? data + off : data, len - off,
                                           flags | KVC_STATE_NO_ROOM, layout, &plans[k], err);
        if (rc == KVC_OK) {
            off += plans[k].len;
        } else if (n_parts > 1) {
            kvc_err_wrap(err, rc, "part %" PRIu32 " of %" PRIu32 " (from byte %zu)", k, n_parts, off);
        } else if (off) {
            kvc_err_wrap(err, rc, "memory state (from byte %zu)", off);
        }
    }
    if (rc == KVC_OK && (flags & KVC_STATE_EXACT)) {
        rc = kvc_state_check_end(off, len, err);
    }
    if (rc == KVC_OK) {
        uint32_t j = 0;
        rc = kvc_state_plan_room_parts(caches, plans, n_parts, &j, err);
        if (rc != KVC_OK && n_parts > 1) {
            kvc_err_wrap(err, rc, "part %" PRIu32 " of %" PRIu32 " (from byte %zu)", j, n_parts, at[j]);
        } else if (rc != KVC_OK && at[j]) {
            kvc_err_wrap(err, rc, "memory state (from byte %zu)", at[j]);
        }
    }
    if (rc != KVC_OK) {
        for (uint32_t j = 0; j < k && j < n_parts; j++) {
            kvc_state_plan_free(&plans[j]);
        }
        return rc;
    }
    *end = off;
    return KVC_OK;
}

static void free_plans(kvc_state_plan *plans, uint32_t n) {
    for (uint32_t k = 0; k < n; k++) {
        kvc_state_plan_free(&plans[k]);
    }
}

/* Where the parts start: after the sequence-blob prefix when the layout has one and it is there. */
static int parts_base(int32_t seq_id, const uint8_t *data, size_t len, unsigned layout, size_t *base, kvc_err *err) {
    *base = 0;
    if (!(layout & KVC_LAYOUT_PREFIX)) {
        return KVC_OK;
    }
    return kvc_state_prefix_take(data, len, seq_id, base, err);
}

/* Whether prepared plans hold any cell (without one, the size of a cell's extension is moot). */
static bool plans_have_cells(const kvc_state_plan *plans, uint32_t n) {
    for (uint32_t k = 0; k < n; k++) {
        const kvc_state_sec *secs = kvc_state_plan_secs(&plans[k]);
        for (uint32_t s = 0; s < plans[k].n_sec; s++) {
            if (secs[s].cell_count) {
                return true;
            }
        }
    }
    return false;
}

/* --- detection: the layout of a state that does not say it ------------------------------------
 * One walk of each candidate layout without the caches (kvc_state_frames_exactly: the section
 * parser's checks of structure alone) says which layouts the bytes frame in. A read against the
 * caches takes bytes only in such a layout (a single sequence's read ignoring the ids its cells
 * list, which the walk checks: the walk tells that case apart), so only those are read, in the
 * candidates' order; when none of them takes the bytes, the same walk picks the error worth
 * telling. The walk cannot stand in for the read: the read checks everything against the caches. */

/* A candidate layout of a detection and the caches' verdict on it. */
typedef struct detect_cand {
    unsigned layout;   /* what the read is given */
    int      rc;       /* KVC_OK: the plans are ready */
    size_t   end;
    kvc_err  err;
} detect_cand;

/* The read of the parts in candidate c, to exactly len. */
static void detect_read(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data, size_t len,
                        size_t base, unsigned flags, detect_cand *c, kvc_state_plan *plans) {
    c->err.msg[0] = 0;
    c->end = 0;
    c->rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags | KVC_STATE_EXACT, c->layout, plans,
                          &c->end, &c->err);
}

/* Detection for caches without the per-cell extension and bytes without the prefix: with stream
 * counts (`streams`) or without; the read against the caches tells far more apart than the
 * structure. Exactly one must take the bytes. KVC_OK with plans ready, *end and *layout set. */
static int detect_streams(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data,
                          size_t len, unsigned flags, unsigned streams, kvc_state_plan *plans, size_t *end,
                          unsigned *layout, kvc_err *err) {
    static const unsigned walks[2] = { KVC_LAYOUT_STREAMS, 0 };
    detect_cand cand[2] = { { .layout = streams | KVC_LAYOUT_STREAMS }, { .layout = 0 } };
    kvc_state_plan other[KVC_STATE_MAX_PARTS];
    uint32_t framing, readable;
    kvc_state_frames_exactly(data, len, walks, 2, n_parts, seq_id >= 0, &framing, &readable);
    for (uint32_t k = 0; k < 2; k++) {
        cand[k].rc = KVC_E_STATE;
        if (readable & (1u << k)) {
            detect_read(caches, n_parts, seq_id, data, len, 0, flags, &cand[k], k ? other : plans);
        }
    }
    if (cand[0].rc == KVC_OK && cand[1].rc == KVC_OK) {
        free_plans(plans, n_parts);
        free_plans(other, n_parts);
        return kvc_err_set(err, KVC_E_STATE,
                           "the state reads both with and without stream counts (%zu bytes): pass the layout to "
                           "say which", len);
    }
    if (cand[1].rc == KVC_OK) {
        memcpy(plans, other, sizeof other);
    }
    for (uint32_t k = 0; k < 2; k++) {
        if (cand[k].rc == KVC_OK) {
            *end = cand[k].end;
            *layout = cand[k].layout;
            return KVC_OK;
        }
    }
    /* neither: the error of the framing the bytes have, when only one fits them (read above) */
    const bool framed[2] = { framing & 1u, framing & 2u };
    if (framed[0] != framed[1]) {
        const detect_cand *c = &cand[framed[0] ? 0 : 1];
        return kvc_err_set(err, c->rc, "%s", c->err.msg);
    }
    if (!framed[0]) {
        /* the bytes are no state's in either framing: what either read made of its counts would be
         * numbers read from garbage, so say what the bytes are not */
        return kvc_err_set(err, KVC_E_STATE,
                           "not a cache state (%zu bytes): it frames as one in no layout, with or without stream "
                           "counts (damaged, truncated or other data; pass the layout to see where a read of it "
                           "stops)", len);
    }
    const int code = cand[0].rc == KVC_E_STATE || cand[1].rc != KVC_E_STATE ? cand[0].rc : cand[1].rc;
    return kvc_err_set(err, code, "in no layout: with stream counts, %.100s; without, %.100s", cand[0].err.msg,
                       cand[1].err.msg);
}

/* Detection for caches with the per-cell extension: the layouts a state of theirs may be in (the
 * newest first; with the prefix, those that have one), each read against the caches where the
 * bytes frame in it; exactly one must take the input whole (a state without cells reads alike in
 * each: the first is taken). KVC_OK with plans ready, *end and *layout set. */
static int detect_ext(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id, const uint8_t *data, size_t len,
                      size_t base, unsigned flags, kvc_state_plan *plans, size_t *end, unsigned *layout,
                      kvc_err *err) {
    const unsigned xy = KVC_LAYOUT_STREAMS | KVC_LAYOUT_EXT_XY;
    detect_cand cand[4] = { { .layout = xy | KVC_LAYOUT_EXT_TOK }, { .layout = xy }, { .layout = KVC_LAYOUT_STREAMS },
                            { .layout = 0 } };
    const uint32_t n_cand = base ? 2 : 4;
    unsigned walks[4];
    for (uint32_t k = 0; k < n_cand; k++) {
        walks[k] = cand[k].layout | KVC_LAYOUT_CELL_EXT;
    }
    uint32_t framing, readable;
    kvc_state_frames_exactly(base ? data + base : data, len - base, walks, n_cand, n_parts, seq_id >= 0, &framing,
                             &readable);
    kvc_state_plan other[KVC_STATE_MAX_PARTS];
    uint32_t n_ok = 0;
    for (uint32_t k = 0; k < n_cand; k++) {
        cand[k].rc = KVC_E_STATE;
        if (!(readable & (1u << k))) {
            continue;
        }
        detect_read(caches, n_parts, seq_id, data, len, base, flags, &cand[k], n_ok ? other : plans);
        if (cand[k].rc != KVC_OK) {
            continue;
        }
        if (n_ok++) {
            free_plans(plans, n_parts);
            free_plans(other, n_parts);
            return kvc_err_set(err, KVC_E_STATE,
                               "the state reads in more than one layout (%zu bytes; cells with and without their "
                               "extension, or with streams and without): pass the layout to say which", len);
        }
        *end = cand[k].end;
        *layout = cand[k].layout;
        if (!plans_have_cells(plans, n_parts)) {
            break;
        }
    }
    if (n_ok) {
        return KVC_OK;
    }
    /* none: the error worth telling is the one of the layout whose framing the bytes have (read
     * above), else the newest layout's */
    const detect_cand *framed = NULL;
    uint32_t n_framed = 0;
    for (uint32_t k = 0; k < n_cand; k++) {
        if (framing & (1u << k)) {
            n_framed++;
            framed = &cand[k];
        }
    }
    if (n_framed == 1) {
        return kvc_err_set(err, KVC_E_STATE, "%s", framed->err.msg);
    }
    if (!(readable & 1u)) {
        detect_read(caches, n_parts, seq_id, data, len, base, flags, &cand[0], plans);
        if (cand[0].rc == KVC_OK) {
            free_plans(plans, n_parts);   /* a read the walk ruled out: no layout to take */
        }
    }
    return kvc_err_set(err, KVC_E_STATE, "in no layout; as today's (12-byte cell extensions): %.200s",
                       cand[0].err.msg);
}

int kvc_unified_state_read_parts_lay(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                     const uint8_t *data, size_t len, unsigned flags, unsigned layout,
                                     size_t *consumed, unsigned *used, kvc_err *err) {
    kvc_state_plan plans[KVC_STATE_MAX_PARTS];
    size_t end = 0, base = 0;
    int rc;
    *consumed = 0;
    if (n_parts == 0 || n_parts > KVC_STATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "%" PRIu32 " parts: expected 1 to %d", n_parts, KVC_STATE_MAX_PARTS);
    }
    for (uint32_t k = 0; k < n_parts; k++) {
        for (uint32_t j = 0; j < k; j++) {
            if (caches[j] == caches[k]) {
                /* a prepared plan is only valid for the cache as it was */
                return kvc_err_set(err, KVC_E_ARG, "parts %" PRIu32 " and %" PRIu32 " name the same cache", j, k);
            }
        }
    }
    if (layout & KVC_LAYOUT_DETECT) {
        const unsigned streams = layout & ~(unsigned)KVC_LAYOUT_DETECT;
        if ((rc = parts_base(seq_id, data, len, KVC_LAYOUT_PREFIX, &base, err)) != KVC_OK) {
            return rc;
        }
        bool ext = false;
        for (uint32_t k = 0; k < n_parts; k++) {
            ext = ext || kvc_unified_has_ext(caches[k]);
        }
        if (ext) {
            rc = detect_ext(caches, n_parts, seq_id, data, len, base, flags, plans, &end, &layout, err);
            if (rc == KVC_OK && base) {
                layout |= KVC_LAYOUT_PREFIX;
            }
        } else if (base) {
            layout = streams; /* only the stream layouts have the prefix */
            rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags, layout, plans, &end, err);
        } else {
            rc = detect_streams(caches, n_parts, seq_id, data, len, flags, streams, plans, &end, &layout, err);
        }
    } else {
        if ((rc = parts_base(seq_id, data, len, layout, &base, err)) != KVC_OK) {
            return rc;
        }
        rc = prepare_parts(caches, n_parts, seq_id, data, len, base, flags, layout, plans, &end, err);
    }
    if (rc != KVC_OK) {
        return rc;
    }
    /* phase 2: apply them all; a prepared plan applies without failing */
    for (uint32_t k = 0; k < n_parts && rc == KVC_OK; k++) {
        rc = kvc_unified_state_apply(caches[k], &plans[k]);
        if (rc != KVC_OK) {
            kvc_err_set(err, rc, "part %" PRIu32 ": the cache changed after it was prepared", k);
        }
    }
    free_plans(plans, n_parts);
    if (rc == KVC_OK) {
        *consumed = end;
        if (used) {
            *used = layout;
        }
    }
    return rc;
}

int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, size_t *consumed,
                           kvc_err *err) {
    return kvc_unified_state_read_ex(c, seq_id, data, len, 0, consumed, err);
}

int kvc_unified_state_read_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                              size_t *consumed, kvc_err *err) {
    kvc_unified *const caches[1] = { c };
    return kvc_unified_state_read_parts_ex(caches, 1, seq_id, data, len, flags, consumed, err);
}
