# Declarations of csrc/kvc_reuse.h and csrc/kvc_retain.h: prefix reuse on a 2026 unified cache.
from libc.stdint cimport int32_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_cells cimport kvc_cell_ext
from kvcache.includes.kvc_unified cimport kvc_unified

cdef extern from "kvc_retain.h" nogil:
    ctypedef struct kvc_prefix_handle:
        uint32_t node
        uint32_t gen
    ctypedef struct kvc_prefix_spill:
        uint32_t n
        uint64_t *salt
        uint32_t *start
        int32_t *tok
        uint32_t *cell
        uint32_t *strm
        uint32_t min_len
        uint64_t n_lost
    ctypedef struct kvc_prefix:
        uint32_t cap
        uint32_t n_held
        uint32_t n_evictable
        uint32_t n_nodes
        kvc_prefix_spill *spill
    ctypedef struct kvc_reuse:
        kvc_prefix idx
        kvc_cell_ext *ext
        int32_t *pos

    size_t kvc_reuse_at(const kvc_reuse *r, uint32_t st, uint32_t i)
    int  kvc_reuse_enable(kvc_unified *c, uint32_t cap, kvc_err *err)
    void kvc_reuse_disable(kvc_unified *c)
    uint32_t kvc_reuse_evict(kvc_unified *c, uint32_t n)
    int  kvc_reuse_check(const kvc_unified *c, kvc_err *err)
    int  kvc_prefix_spill_set(kvc_prefix *idx, bint on, uint32_t min_len, kvc_err *err)
    void kvc_prefix_spill_clear(kvc_prefix *idx)
    uint32_t kvc_reuse_n_cells(const kvc_unified *c)

    ctypedef struct kvc_retained:
        uint32_t n_kept
        uint32_t n_new
        uint32_t n_evicted
    int kvc_retain_release(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                           kvc_retained *res, kvc_err *err)
    int kvc_retain_publish(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                           kvc_retained *res, kvc_err *err)
    uint32_t kvc_retain_match(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n)
    uint32_t kvc_retain_seq_cells(const kvc_unified *c, int32_t s)
    int kvc_retain_attach(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                          uint32_t *n_attached, kvc_err *err)
    int kvc_retain_pin(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_prefix_handle *pin,
                       kvc_err *err)
    int kvc_retain_unpin(kvc_unified *c, kvc_prefix_handle pin, kvc_err *err)
    bint kvc_retain_pin_held(const kvc_unified *c, kvc_prefix_handle pin)
    int kvc_retain_enable_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t cap, kvc_err *err)
    int kvc_retain_enable_window_pair(kvc_unified *base, kvc_unified *swa, uint32_t cap, kvc_err *err)
    uint32_t kvc_retain_match_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                    uint32_t n)
    int kvc_retain_attach_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                                const int32_t *tokens, uint32_t n, uint32_t *n_attached, kvc_err *err)
    uint32_t kvc_retain_match_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt,
                                       const int32_t *tokens, const int32_t *pos, const int32_t *pos_x,
                                       const int32_t *pos_y, uint32_t n)
    int kvc_retain_attach_parts_xy(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                                   const int32_t *tokens, const int32_t *pos, const int32_t *pos_x,
                                   const int32_t *pos_y, uint32_t n, uint32_t *n_attached, kvc_err *err)
    int kvc_retain_release_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                                 const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err)
    int kvc_retain_publish_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                                 const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err)
    int kvc_retain_pin_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y, uint32_t n,
                                kvc_prefix_handle *pins, kvc_err *err)
    int kvc_retain_unpin_parts(kvc_unified *const *cs, uint32_t n_parts, const kvc_prefix_handle *pins,
                               kvc_err *err)
    uint32_t kvc_retain_evict_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t n)
    uint32_t kvc_retain_match_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                                 const int32_t *pos_x, const int32_t *pos_y, uint32_t n)
    int kvc_retain_attach_xy(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                             const int32_t *pos_x, const int32_t *pos_y, uint32_t n, uint32_t *n_attached,
                             kvc_err *err)
    int kvc_retain_pin_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                          const int32_t *pos_x, const int32_t *pos_y, uint32_t n, kvc_prefix_handle *pin,
                          kvc_err *err)
