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

/* --- two-phase reading: several parts into several caches, all or nothing ------------------
 * A state may be made of consecutive parts, one per cache (an iSWA cache writes the part of its
 * base cache, then the part of its SWA cache). Reading it must leave every cache unchanged when
 * any part fails, including a later part failing after an earlier one was fine: so every part
 * is first prepared (parsed, validated and, for a single sequence, given a slot by a dry run of
 * the slot search) while nothing changes, and only then are the parts applied, which cannot fail. */

#define KVC_STATE_MAX_PARTS 8

/* One validated part, ready to apply to the cache it was prepared against. */
typedef struct kvc_state_plan {
    const uint8_t *data;       /* the part (borrowed: must outlive the plan) */
    int32_t        seq_id;     /* destination: -1 = whole cache */
    uint32_t       cell_count; /* cells the part holds */
    size_t         data_off;   /* offset of its data section (the V layout flag) */
    size_t         len;        /* bytes of the part */
    int32_t       *pos;        /* single sequence: the cells' positions (owned), else NULL */
} kvc_state_plan;

/* Validate the part at data[0, len) for seq_id and, for a single sequence, check that its cells
 * find room. Nothing observable in c changes (internal capacities may grow, so that the apply
 * cannot run out of memory). KVC_OK with plan filled (release it with kvc_state_plan_free), or
 * a negative code with err and nothing to release. */
int  kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               kvc_state_plan *plan, kvc_err *err);
/* Apply a plan to the cache it was prepared against, unchanged since: KVC_OK. (A negative code
 * only when c was changed in between, which breaks the contract.) */
int  kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan);
void kvc_state_plan_free(kvc_state_plan *plan);   /* safe on a zeroed plan */

/* Read n_parts (1..KVC_STATE_MAX_PARTS) consecutive parts from data[0, len), part k into
 * caches[k] (distinct caches), for seq_id (-1 = whole caches). All or nothing: on failure
 * every cache is exactly as it was and err names the part. *consumed = bytes of all parts. */
int  kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                  const uint8_t *data, size_t len, size_t *consumed, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
