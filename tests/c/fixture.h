/* The cache fixture of the placement tests: a one-layer cache over the test's own zeroed K and
 * V arrays. */
#ifndef KVC_TEST_FIXTURE_H
#define KVC_TEST_FIXTURE_H

#include "kvc_unified.h"

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

#endif
