/* kvcache — the state codec of the unified cache, byte-identical to llama.cpp's
 * llama_kv_cache_unified::state_write / state_read (the bytes: docs/format.md). The codec's
 * public header; its parts, bottom up:
 * kvc_layout.h (layout bits, magic, descriptors), kvc_section.h (the one parser of a section),
 * kvc_state_write.h (writing), kvc_state_plan.h (a validated part and what both semantics' readers
 * share), kvc_state_2025.h and kvc_state_2026.h (the readers of the two semantics), and here the
 * transactional reads of several parts and the detection of a blob's layout.
 *
 * Reading is transactional: the whole blob is parsed and validated before anything
 * changes; on any failure the cache (cells, head, n, recovery, defrag state, every
 * K/V byte) is exactly as it was, and err says what is wrong and where. */
#ifndef KVC_STATE_H
#define KVC_STATE_H

#include "kvc_common.h"
#include "kvc_layout.h"
#include "kvc_section.h"
#include "kvc_slot.h"
#include "kvc_state_2025.h"
#include "kvc_state_2026.h"
#include "kvc_state_plan.h"
#include "kvc_state_write.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Read one cache state from data[0, len) into seq_id (-1 = whole cache). On success KVC_OK and
 * *consumed = bytes of the state (trailing bytes are not read). On failure a negative code,
 * err filled, and no change at all. A single-sequence part with cell_count 0 removes seq_id
 * (contract C1b). Negative positions and out-of-range sequence ids are rejected. Codes:
 * KVC_E_STATE (malformed or incompatible blob, or no run of free cells for a single sequence),
 * KVC_E_NOMEM, KVC_E_ARG (seq_id outside [-1, n_seq_max)). A successful read leaves nothing
 * placed (kvc_slot.h); a whole-cache read also empties the undo log, so that a restore()
 * afterwards cannot empty cells the read filled (a single sequence's read commits when it
 * places cells, as llama.cpp's). */
int kvc_unified_state_read(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                           size_t *consumed, kvc_err *err);

/* kvc_unified_state_read with flags (enum kvc_state_flags). With KVC_STATE_CONVERT_V a blob whose
 * V layout differs from the cache's is accepted when the V type stores one element per block,
 * and its V data is transposed on the way in; everything else is checked as without it. */
int kvc_unified_state_read_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                              size_t *consumed, kvc_err *err);

/* --- two-phase reading: several parts into several caches, all or nothing ------------------
 * A state may be made of consecutive parts, one per cache (an iSWA cache writes the part of its
 * base cache, then the part of its SWA cache). Reading it must leave every cache unchanged when
 * any part fails, including a later part failing after an earlier one was fine: so every part
 * is first prepared (parsed, validated and, for a single sequence, given a slot by a dry run of
 * the slot search) while nothing changes, and only then are the parts applied, which cannot fail. */

/* Validate the part at data[0, len) for seq_id and, for a single sequence, check that its cells
 * find room. Nothing observable in c changes (internal capacities may grow, so that the apply
 * cannot run out of memory). KVC_OK with plan filled (release it with kvc_state_plan_free), or
 * a negative code with err and nothing to release. */
int  kvc_unified_state_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                               kvc_state_plan *plan, kvc_err *err);
/* Apply a plan to the cache it was prepared against, unchanged since: KVC_OK. (A negative code
 * only when c was changed in between, which breaks the contract.) The cells come from the plan,
 * not from the data again, so data changed since the prepare (a buffer another thread writes
 * into) cannot make the apply read or write out of bounds; only K/V bytes are copied from it. */
int  kvc_unified_state_apply(kvc_unified *c, const kvc_state_plan *plan);

/* Read n_parts (1..KVC_STATE_MAX_PARTS) consecutive parts from data[0, len), part k into
 * caches[k] (distinct caches), for seq_id (-1 = whole caches). All or nothing: on failure
 * every cache is exactly as it was and err names the part. *consumed = bytes of all parts. */
int  kvc_unified_state_read_parts(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                  const uint8_t *data, size_t len, size_t *consumed, kvc_err *err);

/* The same with flags (enum kvc_state_flags): KVC_STATE_CONVERT_V for every part; with
 * KVC_STATE_EXACT the last part must end at len. */
int  kvc_unified_state_prepare_ex(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                  kvc_state_plan *plan, kvc_err *err);
int  kvc_unified_state_read_parts_ex(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                     const uint8_t *data, size_t len, unsigned flags, size_t *consumed,
                                     kvc_err *err);

/* The readers in a layout (enum kvc_layout_bits). With KVC_LAYOUT_STREAMS the stream count must
 * be the cache's ("n_stream mismatch" otherwise), and a single sequence's state may start with
 * the sequence-blob prefix (its magic checked, its id ignored, as llama.cpp does). With
 * KVC_LAYOUT_DETECT the layout is found: a leading KVC_SEQ_MAGIC means the stream layout, else
 * the state must parse to exactly len bytes in one of the two (seed, streams); when both do,
 * KVC_E_STATE asks for the layout. *used (may be NULL) = the layout read. */
int  kvc_unified_state_prepare_lay(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len,
                                   unsigned flags, unsigned layout, kvc_state_plan *plan, kvc_err *err);
int  kvc_unified_state_read_parts_lay(kvc_unified *const *caches, uint32_t n_parts, int32_t seq_id,
                                      const uint8_t *data, size_t len, unsigned flags, unsigned layout,
                                      size_t *consumed, unsigned *used, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
