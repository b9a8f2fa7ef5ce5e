# Declarations of csrc/kvc_checkpoint.h and csrc/kvc_hybrid_prefix.h: prefix reuse for recurrent
# and hybrid memories (checkpoints of recurrent states).
from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_recurrent cimport kvc_recurrent
from kvcache.includes.kvc_hybrid cimport kvc_hybrid
from kvcache.includes.kvc_retain cimport kvc_prefix_handle, kvc_retained

cdef extern from "kvc_checkpoint.h" nogil:
    ctypedef struct kvc_ckpt_handle:
        uint32_t slot
        uint32_t gen
    ctypedef struct kvc_ckpt_spill:
        uint32_t n
        uint64_t n_lost
        uint64_t *salt
        uint32_t *n_tok
        int32_t **tokens
    ctypedef struct kvc_ckpt_pool:
        uint32_t cap
        uint32_t per_seq
        size_t state_bytes
        bint owns_data
        uint32_t n_used
        uint32_t *n_tok
        uint64_t *salt
        int32_t **tokens
        uint32_t *pins
        int32_t *owner
        uint32_t *order
        kvc_ckpt_spill *spill

    size_t kvc_ckpt_state_bytes(const kvc_recurrent *c)
    int  kvc_ckpt_init(kvc_ckpt_pool *p, const kvc_recurrent *c, uint32_t cap, uint32_t per_seq, uint8_t *memory,
                       size_t memory_len, kvc_err *err)
    void kvc_ckpt_free(kvc_ckpt_pool *p)
    uint32_t kvc_ckpt_seq_len(const kvc_recurrent *c, int32_t s)
    int  kvc_ckpt_save(kvc_ckpt_pool *p, const kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                       uint32_t n, int32_t *copy, uint32_t *n_kept, kvc_err *err)
    uint32_t kvc_ckpt_match(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n)
    int  kvc_ckpt_attach(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                         uint32_t n, uint32_t *n_attached, kvc_err *err)
    int  kvc_ckpt_release(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                          uint32_t n, uint32_t *n_kept, kvc_err *err)
    int  kvc_ckpt_pin(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_ckpt_handle *pin,
                      kvc_err *err)
    int  kvc_ckpt_unpin(kvc_ckpt_pool *p, kvc_ckpt_handle pin, kvc_err *err)
    bint kvc_ckpt_pin_held(const kvc_ckpt_pool *p, kvc_ckpt_handle pin)
    uint32_t kvc_ckpt_evict(kvc_ckpt_pool *p, uint32_t n)
    int  kvc_ckpt_spill_set(kvc_ckpt_pool *p, bint on, uint32_t align, kvc_err *err)
    void kvc_ckpt_spill_clear(kvc_ckpt_pool *p)
    const uint8_t *kvc_ckpt_spill_state(const kvc_ckpt_pool *p, uint32_t k)
    uint32_t kvc_ckpt_n_pinned(const kvc_ckpt_pool *p)
    int  kvc_ckpt_check(const kvc_ckpt_pool *p, kvc_err *err)
    uint32_t kvc_ckpt_copy_seq(const kvc_recurrent *c, int32_t s, uint8_t *out)
    bint kvc_ckpt_copy_out(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, uint8_t *out)
    int  kvc_ckpt_restore_state(kvc_recurrent *c, int32_t s, uint32_t n_tok, const uint8_t *state, kvc_err *err)

cdef extern from "kvc_hybrid_prefix.h" nogil:
    uint32_t kvc_hybrid_prefix_match(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens,
                                     uint32_t n)
    int kvc_hybrid_prefix_attach(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                                 uint32_t n, uint32_t *n_attached, kvc_err *err)
    int kvc_hybrid_prefix_release(kvc_hybrid *h, kvc_ckpt_pool *p, int32_t s, uint64_t salt, const int32_t *tokens,
                                  uint32_t n, uint32_t *n_hit, kvc_retained *attn, kvc_err *err)
    int kvc_hybrid_prefix_pin(kvc_hybrid *h, kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n,
                              kvc_ckpt_handle *ckpt, kvc_prefix_handle *attn, kvc_err *err)
    int kvc_hybrid_prefix_unpin(kvc_hybrid *h, kvc_ckpt_pool *p, kvc_ckpt_handle ckpt, const kvc_prefix_handle *attn,
                                kvc_err *err)
    void kvc_hybrid_prefix_evict(kvc_hybrid *h, kvc_ckpt_pool *p, uint32_t n_cells, uint32_t n_ckpts, uint32_t *cells,
                                 uint32_t *ckpts)
