/* kvcache — the state codec of the unified cache, byte-identical to llama.cpp's
 * llama_kv_cache_unified::state_write / state_read (layout: ../golden/FORMAT.md,
 * "state_write / state_read blobs").
 *
 * Reading is transactional: the whole blob is parsed and validated before anything
 * changes; on any failure the cache (cells, head, n, recovery, defrag state, every
 * K/V byte) is exactly as it was, and err says what is wrong and where. */
#ifndef KVC_STATE_H
#define KVC_STATE_H

#include "kvc_common.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes state_write would produce for seq_id (-1 = whole cache); 0 for an id outside
 * [-1, n_seq_max). */
size_t kvc_unified_state_size(const kvc_unified *c, int32_t seq_id);

/* Write the state of seq_id (-1 = all) into out[0, cap). KVC_OK with *written set, or
 * KVC_E_NOSPACE when cap is too small (nothing meaningful written), KVC_E_ARG for an id outside
 * [-1, n_seq_max). Layers without K/V memory write zeros for their data. */
int kvc_unified_state_write(const kvc_unified *c, int32_t seq_id, uint8_t *out, size_t cap, size_t *written);

/* Read one cache state from data[0, len) into seq_id (-1 = whole cache). On success KVC_OK and
 * *consumed = bytes of the state (trailing bytes are not read). On failure a negative code,
 * err filled, and no change at all. A single-sequence part with cell_count 0 removes seq_id
 * (contract C1b). Negative positions and out-of-range sequence ids are rejected. Codes:
 * KVC_E_STATE (malformed or incompatible blob, or no run of free cells for a single sequence),
 * KVC_E_NOMEM, KVC_E_ARG (seq_id outside [-1, n_seq_max)). */
int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                           size_t *consumed, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
