/* kvcache — the update() of unified caches (see kvc_update.h). */
#include "kvc_update.h"
#include "kvc_defrag.h"

#include "kvc_kshift.h"

#include <string.h>

/* The part that cannot fail once the rotation (if any) is prepared. */
static int kvc_update_run(kvc_unified *c, const kvc_update_opts *o, kvc_kshift_work *work, kvc_update_result *r,
                          kvc_err *err) {
    memset(r, 0, sizeof *r);
    kvc_unified_defrag_settle(c);
    const bool memory = kvc_unified_has_memory(c);
    if (o->stream_copies) {
        r->copies = kvc_unified_stream_copies(c);
    }
    if (kvc_unified_any_shift(c)) {
        r->shifted = true;
        if (o->k_shift) {
            kvc_unified_k_shift(c, o->k_shift);
        }
        if (work) {
            const int rc = kvc_unified_k_shift_run(c, o->rope, o->head_dim, work, err);
            if (rc != KVC_OK) {
                return rc;   /* only when an invariant broke: the prepare checked everything */
            }
            r->rotated = true;
        }
        for (uint32_t s = 0; s < c->n_stream; s++) {
            kvc_cells_reset_shift(kvc_unified_stream_cells(c, s));
        }
    }
    if (c->do_defrag) {
        /* the plan (defrag_ids) outlives the move: its runs are read afterwards */
        r->defragged = kvc_unified_defrag_prepare(c, o->n_max_nodes) == 1;
        kvc_unified_defrag_move(c);
        r->moved = r->defragged && memory;
    }
    r->need_reserve = r->rotated || r->moved || r->copies > 0 || (!memory && (r->shifted || r->defragged));
    return KVC_OK;
}

int kvc_unified_update_parts(kvc_unified *const *caches, uint32_t n, const kvc_update_opts *opts,
                             kvc_update_result *res, kvc_err *err) {
    kvc_kshift_work works[KVC_UPDATE_MAX_PARTS];
    bool prepared[KVC_UPDATE_MAX_PARTS] = { false };
    int rc = KVC_OK;
    if (n == 0 || n > KVC_UPDATE_MAX_PARTS) {
        return kvc_err_set(err, KVC_E_ARG, "update: %u caches, expected 1 to %d", n, KVC_UPDATE_MAX_PARTS);
    }
    for (uint32_t k = 0; k < n; k++) {
        for (uint32_t j = 0; j < k; j++) {
            if (caches[j] == caches[k]) {
                return kvc_err_set(err, KVC_E_ARG, "update: caches %u and %u are the same", j, k);
            }
        }
    }
    /* phase 1: every rotation checked and allocated while nothing changes */
    for (uint32_t k = 0; k < n && rc == KVC_OK; k++) {
        if (kvc_unified_any_shift(caches[k]) && opts[k].rope) {
            rc = kvc_unified_k_shift_prepare(caches[k], opts[k].rope, opts[k].head_dim, &works[k], err);
            prepared[k] = rc == KVC_OK;
        }
    }
    if (rc != KVC_OK) {
        for (uint32_t k = 0; k < n; k++) {
            if (prepared[k]) {
                kvc_kshift_work_free(&works[k]);
            }
        }
        return rc;
    }
    /* phase 2: apply (a prepared rotation releases its scratch when it runs) */
    for (uint32_t k = 0; k < n; k++) {
        const int r = kvc_update_run(caches[k], &opts[k], prepared[k] ? &works[k] : NULL, &res[k], err);
        if (r != KVC_OK && rc == KVC_OK) {
            rc = r;
        }
    }
    return rc;
}

int kvc_unified_update(kvc_unified *c, const kvc_update_opts *opts, kvc_update_result *res, kvc_err *err) {
    kvc_unified *const caches[1] = { c };
    return kvc_unified_update_parts(caches, 1, opts, res, err);
}
