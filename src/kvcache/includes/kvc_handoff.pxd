# Declarations of csrc/kvc_handoff.h: a sequence's header and K/V regions for a transfer, and the
# transactional import on the receiving side.
from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_unified cimport kvc_unified, kvc_unified_snapshot

cdef extern from "kvc_handoff.h" nogil:
    ctypedef struct kvc_run:
        uint32_t first, n

    ctypedef struct kvc_handoff_export:
        uint8_t *header
        size_t header_len
        kvc_run *runs
        uint32_t n_runs
        uint32_t stream
        uint32_t cell_count
        uint64_t data_bytes

    uint64_t kvc_handoff_checksum(const uint8_t *p, size_t n)

    int  kvc_handoff_export_make(kvc_unified *c, int32_t s, kvc_handoff_export *e, kvc_err *err)
    void kvc_handoff_export_free(kvc_handoff_export *e)

    uint64_t kvc_handoff_n_regions(const kvc_unified *c, uint32_t n_runs)
    void kvc_handoff_regions(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                             uint64_t *out)
    void kvc_handoff_gather(const kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                            uint8_t *out)
    void kvc_handoff_scatter(kvc_unified *c, uint32_t stream, const kvc_run *runs, uint32_t n_runs,
                             const uint8_t *src)

    ctypedef struct kvc_handoff_import:
        kvc_unified *c
        int32_t seq_id
        uint32_t cell_count
        int32_t *pos
        kvc_run *runs
        uint32_t n_runs
        uint32_t stream
        uint64_t data_bytes
        uint8_t *backup
        kvc_unified_snapshot snap
        bint active

    int  kvc_handoff_import_begin(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                                  kvc_handoff_import *imp, kvc_err *err)
    int  kvc_handoff_import_begin_empty(kvc_unified *c, int32_t seq_id, const uint8_t *header, size_t len,
                                        kvc_handoff_import *imp, kvc_err *err)
    int  kvc_handoff_import_begin_parts(kvc_unified **cs, uint32_t n, int32_t seq_id, const uint8_t **headers,
                                        const size_t *lens, kvc_handoff_import **imps, kvc_err *err)
    int  kvc_handoff_import_check(const kvc_handoff_import *imp, kvc_err *err)
    int  kvc_handoff_import_commit(kvc_handoff_import *imp, kvc_err *err)
    void kvc_handoff_import_abort(kvc_handoff_import *imp)
