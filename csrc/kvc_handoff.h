/* kvcache — handing one sequence of a unified cache to another process without serialising it:
 * a small header (the sequence's cells and the cache geometry) plus the memory regions of its
 * K/V rows, which a transfer library reads or writes in place; on the receiving side a
 * transactional import that reserves cells by the placement of a single-sequence state read,
 * lets the transfer write into them, then commits (or undoes every byte). Both semantics: the
 * cells are those of a single-sequence state in the cache's era (2025: the seed's; 2026: the
 * cells of the sequence's stream that today's state lists, SWA-masked ones left out), the
 * placement that of the destination's state read.
 *
 * Layout of the header (little-endian; docs/disaggregated.md):
 *   u32 magic "KVCH", u32 version (1), u32 header bytes (checksum included), u32 flags
 *   (bit 0: V transposed, bit 1: the source holds K/V memory, bit 2: the cells carry the per-cell
 *   extension; a header with other bits is refused), i32 type_k, i32 type_v,
 *   u32 n_layer, u64 data bytes (the sum of the region lengths), i32 the source sequence id;
 *   per layer: i32 model layer, u32 n_embd_k, u32 n_embd_v, u64 K row bytes, u64 V row bytes;
 *   u32 runs, per run u32 first source cell (in the sequence's stream), u32 cells;
 *   the cell section of a single-sequence state (u32 cell count; per cell i32 pos, u32 1, with
 *   bit 2 i32 x, i32 y, i32 tok (layout "2026"'s 12 bytes of extension), then i32 id), written by
 *   the state codec;
 *   u64 FNV-1a checksum of every byte before it.
 *
 * Regions enumerate the sequence's K/V bytes in the order of a state's data section: for each
 * layer its K rows run by run, then for each layer its V rows run by run, or, transposed, for each
 * element j of a row the run's elements j (one region per element and run: no gather). */
#ifndef KVC_HANDOFF_H
#define KVC_HANDOFF_H

#include "kvc_common.h"
#include "kvc_layout.h"
#include "kvc_slot.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_HANDOFF_MAGIC 0x4843564Bu /* "KVCH" */
#define KVC_HANDOFF_VERSION 1u

/* The header's checksum: FNV-1a (64 bits) of p[0, n). */
uint64_t kvc_handoff_checksum(const uint8_t *p, size_t n);

/* A run of consecutive cells [first, first + n). */
typedef struct kvc_run {
    uint32_t first, n;
} kvc_run;

/* One exported sequence: its header and the runs of its cells in the source cache. */
typedef struct kvc_handoff_export {
    uint8_t *header;      /* [header_len] (owned) */
    size_t   header_len;
    kvc_run *runs;        /* [n_runs] ascending, cells of `stream` (owned; NULL without cells) */
    uint32_t n_runs;
    uint32_t stream;      /* the sequence's stream (0 with one) */
    uint32_t cell_count;
    uint64_t data_bytes;  /* sum of the region lengths (0 without K/V memory) */
} kvc_handoff_export;

/* Export sequence s (valid id) of c: settles a pending defrag first (the regions must hold the
 * rows). KVC_OK, KVC_E_NOMEM. */
int  kvc_handoff_export_make(kvc_unified *c, int32_t s, kvc_handoff_export *e, kvc_err *err);
void kvc_handoff_export_free(kvc_handoff_export *e);   /* safe on a zeroed export */

/* Regions of the K/V bytes of the cells of runs[0, n_runs) of stream `stream` in c (in the order
 * above); 0 without K/V memory. */
uint64_t kvc_handoff_n_regions(const kvc_unified *c, uint32_t n_runs);
/* out[2k] = address, out[2k + 1] = length of region k, for k < kvc_handoff_n_regions. */
void     kvc_handoff_regions(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                             uint64_t *out);
/* Copy the regions' bytes into out[0, data bytes) / from src[0, data bytes) into the regions. */
void     kvc_handoff_gather(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                            uint8_t *out);
void     kvc_handoff_scatter(kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                             const uint8_t *src);

/* Where a stream stood when an import into a sequence holding no cell began, which its commit
 * checks in place of a copy of the cells: every change of a cell's position, sequences or
 * extension moves the table's (chg_epoch, chg_n) (kvc_cells: an entry in the change log while a
 * reader keeps a place in it, a new epoch otherwise), a shift reset has_shift. */
typedef struct kvc_handoff_mark {
    uint64_t epoch;
    uint32_t chg_n, head;
    bool     has_shift;
} kvc_handoff_mark;

/* An import in progress: the cells it will take, and what they held. */
typedef struct kvc_handoff_import {
    kvc_unified *c;
    int32_t      seq_id;        /* destination */
    uint32_t     cell_count;
    int32_t     *pos;           /* [cell_count] positions from the header (owned) */
    struct kvc_cell_ext *ext;   /* [cell_count] their extensions (owned), NULL when the cache has none */
    kvc_run     *runs;          /* [n_runs] destination runs, in the sequence's cell order (owned) */
    uint32_t     n_runs;
    uint32_t     stream;        /* the destination sequence's stream: the runs' cells are its */
    uint64_t     data_bytes;    /* bytes the regions hold (0 without K/V memory) */
    uint8_t     *backup;        /* [data_bytes] the regions' bytes at begin, for abort (owned) */
    kvc_unified_snapshot snap;  /* the cache at begin: commit refuses a cache changed since */
    kvc_cells   *strms;         /* 2026: [n_strms] every other stream's cells at begin (owned; stream 0's
                                 * are snap's, strms[0] unused) */
    uint32_t    *heads;         /* 2026: [n_strms] their heads */
    uint32_t     n_strms, n_copies; /* 2026: streams copied (0 for 2025), queued stream copies */
    kvc_handoff_mark *marks;    /* into a sequence that held no cell: [c->n_stream] (owned); then snap
                                 * holds no cells and strms nothing */
    bool         active;
} kvc_handoff_import;

/* Validate header[0, len) against c (its extension flag must be c's) and reserve the cells its sequence takes when restored into
 * seq_id (a valid id, or -1 for the header's own), as a single-sequence state read places them; nothing observable changes.
 * KVC_OK with imp active (counted in c->imports until commit or abort), or KVC_E_STATE (foreign geometry, truncation, corruption, no room:
 * err says how many cells are missing), KVC_E_NOMEM; imp inactive then. */
int  kvc_handoff_import_begin(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                              kvc_handoff_import *imp, kvc_err *err);
/* kvc_handoff_import_begin of the n (1..KVC_STATE_MAX_PARTS) parts of a composite cache's export
 * (an iSWA pair's: headers[k], lens[k] into cs[k], imps[k]), all or none: every header is
 * validated (they must name one source sequence) before any part reserves, and a part's prefix
 * index evicts only once every part has room or can make it (kvc_parts_room). KVC_OK with every
 * import active, or an error with err and none active (nothing evicted when one finds no room). */
int  kvc_handoff_import_begin_parts(kvc_unified *const *cs, uint32_t n, int32_t seq_id, const uint8_t *const *headers,
                                    const size_t *lens, kvc_handoff_import *const *imps, kvc_err *err);
/* kvc_handoff_import_begin for a destination sequence that holds no cell: the reserved cells are
 * then free ones whose bytes nothing reads, so no copy of them is kept and an abort leaves what
 * was written into them (every cell, sequence and prefix as before). A destination that holds
 * cells gets the copy as with kvc_handoff_import_begin. */
int  kvc_handoff_import_begin_empty(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                                    kvc_handoff_import *imp, kvc_err *err);
/* Make the sequence visible exactly as the state read would have (its K/V are what the regions
 * hold now, its cells' extensions the header's; in 2026 an empty sequence leaves the
 * destination's cells, as that read does).
 * KVC_E_STATE (nothing changed, the import still active) when the cache changed since begin. */
int  kvc_handoff_import_commit(kvc_handoff_import *imp, kvc_err *err);
/* KVC_OK when the cache is as at begin (commit would place the sequence), KVC_E_STATE when it
 * changed, KVC_E_ARG when the import is inactive: lets an import of several parts check every
 * part before committing any. */
int  kvc_handoff_import_check(const kvc_handoff_import *imp, kvc_err *err);
/* Put back the regions' bytes; the cache is as before begin. No-op when inactive. */
void kvc_handoff_import_abort(kvc_handoff_import *imp);

/* --- what each cache type does its own way (kvc_unified_ops) ------------------------------ */
/* The layout whose single-sequence state the header's cells follow, without the blob prefix:
 * the seed's; today's (stream sections; the cells SWA-masked against the sequence's largest
 * position left out; the per-cell extension, x, y and token id, after each record's n_seq_id
 * when the cache has it). */
#define KVC_HANDOFF_LAYOUT_2025 0u
#define KVC_HANDOFF_LAYOUT_2026 \
    ((unsigned)(KVC_LAYOUT_STREAMS | KVC_LAYOUT_SWA_TRIM | KVC_LAYOUT_EXT_XY | KVC_LAYOUT_EXT_TOK))
/* The cells imp's sequence takes (imp->runs): the dry run of the seed's single-sequence state
 * read, undone; or of today's, in the sequence's stream, its prefix index evicting where room
 * needs it (evict) or not at all. An empty sequence reserves nothing. KVC_OK, KVC_ROOM_EVICTING
 * (!evict: room only by evicting, nothing reserved), KVC_E_STATE (no room: err says how many
 * cells are missing) or KVC_E_NOMEM. */
int  kvc_handoff_reserve_2025(kvc_unified *c, kvc_handoff_import *imp, bool evict, kvc_err *err);
int  kvc_handoff_reserve_2026(kvc_unified *c, kvc_handoff_import *imp, bool evict, kvc_err *err);
/* What the import keeps for its commit's check: into a sequence that holds no cell, each stream's
 * mark (kvc_handoff_mark); else a snapshot of the cache (the seed's one stream; today's also every
 * other stream's cells and heads); and the queued stream copies. false: out of memory (what was
 * kept is released with the import). */
bool kvc_handoff_save_2025(kvc_handoff_import *imp);
bool kvc_handoff_save_2026(kvc_handoff_import *imp);
/* The commit's placement, the reserved cells again: KVC_OK, or an error with err and the cache
 * as at begin. */
int  kvc_handoff_place_2025(kvc_handoff_import *imp, kvc_err *err);
int  kvc_handoff_place_2026(kvc_handoff_import *imp, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
