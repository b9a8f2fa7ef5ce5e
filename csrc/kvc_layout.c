/* kvcache — the byte counts of a memory state (see kvc_layout.h). */
#include "kvc_layout.h"

#include "kvc_types.h"

#include <inttypes.h>

int kvc_state_check_sizes(uint32_t size, uint32_t n_seq_max, int32_t type_k, int32_t type_v, uint32_t n_layer,
                          const uint32_t *n_embd_k, const uint32_t *n_embd_v, kvc_err *err) {
    /* the state: cell count, per cell position, id count and ids, V layout, layer count, per
     * layer two 12-byte headers; the K/V memory: what the state's data sections hold at most */
    uint64_t meta, total = 4 + 4 + 4;
    bool ok = kvc_size_mul(size, 8 + 4 * (uint64_t)n_seq_max, &meta) && kvc_size_add(total, meta, &total);
    for (uint32_t l = 0; ok && l < n_layer; l++) {
        const uint64_t k_row = kvc_row_size(type_k, n_embd_k[l]), v_row = kvc_row_size(type_v, n_embd_v[l]);
        uint64_t kb, vb;
        ok = (k_row || !n_embd_k[l]) && (v_row || !n_embd_v[l]) && kvc_size_mul(k_row, size, &kb) &&
             kvc_size_mul(v_row, size, &vb) && kvc_size_add(total, 24, &total) && kvc_size_add(total, kb, &total) &&
             kvc_size_add(total, vb, &total);
    }
    if (!ok) {
        return kvc_err_set(err, KVC_E_ARG, "a cache of %" PRIu32 " cells and %" PRIu32 " layers of these row "
                           "widths has more bytes of K/V memory or state than a size_t can count (%zu)",
                           size, n_layer, (size_t)SIZE_MAX);
    }
    return KVC_OK;
}
