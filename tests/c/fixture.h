/* The cache fixture of the placement tests: a one-layer cache over the test's own zeroed K and
 * V arrays. */
#ifndef KVC_TEST_FIXTURE_H
#define KVC_TEST_FIXTURE_H

#include "kvc_unified.h"
#include "kvc_unified_ops.h"

#include <string.h>

/* Zero k[nk] / v[nv] (bytes), initialise c from p and attach them as layer 0's K and V. */
static inline int fixture_attach(kvc_unified *c, const kvc_unified_params *p, void *k, size_t nk, void *v,
                                 size_t nv) {
    memset(k, 0, nk);
    memset(v, 0, nv);
    const int rc = kvc_unified_init(c, p, NULL);
    if (rc == KVC_OK) {
        kvc_unified_set_layer_buffers(c, 0, (uint8_t *)k, (uint8_t *)v);
    }
    return rc;
}

/* Fill pos / off / ids (room for n, n + 1 and 2 n entries) with a ubatch of n tokens of sequence
 * s at positions p0, p0 + 1, ..., token i also of sequence t when t >= 0, t != s and i is a
 * multiple of every; *ub describes them. */
static inline const kvc_ubatch *fixture_ub(kvc_ubatch *ub, int32_t *pos, uint32_t *off, int32_t *ids, uint32_t n,
                                           int32_t p0, int32_t s, int32_t t, uint32_t every) {
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = p0 + (int32_t)i;
        off[i] = k;
        ids[k++] = s;
        if (t >= 0 && t != s && i % every == 0) {
            ids[k++] = t;
        }
    }
    off[n] = k;
    *ub = (kvc_ubatch){ n, 1, n, pos, off, ids, NULL, NULL, NULL };
    return ub;
}

#endif
