/* kvcache — the unified cache's K-shift over its K memory (see kvc_kshift.h). */
#include "kvc_kshift.h"
#include "kvc_defrag.h"

#include <string.h>

int kvc_unified_k_shift_prepare(const kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                                kvc_kshift_work *w, kvc_err *err) {
    const kvc_type_info *t = kvc_type_get(c->type_k);
    const size_t rows = (size_t)c->cells.size * c->n_stream;   /* every stream's rows, stream-major */
    size_t scratch_floats = 1;

    memset(w, 0, sizeof *w);
    if (t == NULL) {
        return kvc_err_set(err, KVC_E_ARG, "unknown K type %d", (int)c->type_k);
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        const uint32_t hd = head_dim[l];
        if (hd == 0 || ly->n_embd_k % hd != 0) {
            return kvc_err_set(err, KVC_E_ARG, "layer %d: K rows of %u elements do not hold heads of %u",
                               (int)ly->il, (unsigned)ly->n_embd_k, (unsigned)hd);
        }
        if (hd % t->blck_size != 0) {
            return kvc_err_set(err, KVC_E_ARG, "layer %d: head size %u is not a multiple of the %s block size %u",
                               (int)ly->il, (unsigned)hd, t->name, (unsigned)t->blck_size);
        }
        if (kvc_rope_params_check(&p[l], hd) != KVC_OK) {
            return kvc_err_set(err, KVC_E_ARG, "layer %d: RoPE parameters do not fit heads of %u "
                               "(n_rot = %d must be even and at most the head size)",
                               (int)ly->il, (unsigned)hd, (int)p[l].n_rot);
        }
        const size_t need = kvc_rope_scratch_floats(ly->n_embd_k / hd, hd, p[l].n_rot);
        if (need > scratch_floats) {
            scratch_floats = need;
        }
    }

    w->shift = (int32_t *)kvc_malloc_n(rows ? rows : 1, sizeof(int32_t));
    w->scratch = (float *)kvc_malloc_n(scratch_floats, sizeof(float));
    if (w->shift == NULL || w->scratch == NULL) {
        kvc_kshift_work_free(w);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for the K-shift");
    }
    return KVC_OK;
}

int kvc_unified_k_shift_run(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                            kvc_kshift_work *w, kvc_err *err) {
    const uint32_t rows = c->cells.size * c->n_stream;   /* kvc_unified_init bounds it by INT32_MAX */
    kvc_unified_defrag_settle(c);   /* the rows to rotate must be in their cells */
    kvc_unified_k_shift(c, w->shift);

    int rc = KVC_OK;
    for (uint32_t l = 0; l < c->n_layer && rc == KVC_OK; l++) {
        const kvc_layer *ly = &c->layers[l];
        if (ly->k == NULL) {
            continue;
        }
        /* arguments were checked by the prepare and the scratch is ours: this cannot fail midway */
        rc = kvc_rope_shift_rows(c->type_k, ly->k, rows, ly->n_embd_k / head_dim[l], head_dim[l],
                                 ly->k_row_bytes, w->shift, &p[l], w->scratch);
    }
    kvc_kshift_work_free(w);
    if (rc != KVC_OK) {
        return kvc_err_set(err, KVC_E_INTERNAL, "K-shift failed after the checks passed (%d)", rc);
    }
    return KVC_OK;
}

void kvc_kshift_work_free(kvc_kshift_work *w) {
    kvc_free(w->shift);
    kvc_free(w->scratch);
    w->shift = NULL;
    w->scratch = NULL;
}

int kvc_unified_apply_k_shift(kvc_unified *c, const kvc_rope_params *p, const uint32_t *head_dim,
                              kvc_err *err) {
    kvc_kshift_work w;
    const int rc = kvc_unified_k_shift_prepare(c, p, head_dim, &w, err);
    if (rc != KVC_OK) {
        return rc;
    }
    return kvc_unified_k_shift_run(c, p, head_dim, &w, err);
}
