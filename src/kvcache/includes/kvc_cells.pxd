# Declarations of csrc/kvc_cells.h: the cell table of a unified cache.
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "kvc_cells.h" nogil:
    ctypedef struct kvc_seq_pos:
        int32_t *v
        uint32_t n

    ctypedef struct kvc_cells:
        uint32_t size
        uint32_t n_seq_max
        uint32_t n_words
        int32_t *pos
        int32_t *shift
        uint64_t *seq
        uint64_t *used_bits
        uint32_t used
        uint32_t used_max_p1
        bint has_shift
        kvc_seq_pos seq_pos[64]

    int  kvc_cells_init(kvc_cells *c, uint32_t size, uint32_t n_seq_max)
    void kvc_cells_free(kvc_cells *c)
    void kvc_cells_reset(kvc_cells *c)
    void kvc_cells_reset_shift(kvc_cells *c)

    bint kvc_cells_is_empty(const kvc_cells *c, uint32_t i)
    bint kvc_cells_seq_has(const kvc_cells *c, uint32_t i, int32_t s)
    bint kvc_cells_pos_in(const kvc_cells *c, uint32_t i, int32_t p0, int32_t p1)

    void kvc_cells_pos_set(kvc_cells *c, uint32_t i, int32_t p)
    void kvc_cells_seq_add(kvc_cells *c, uint32_t i, int32_t s)
    bint kvc_cells_seq_rm(kvc_cells *c, uint32_t i, int32_t s)
    void kvc_cells_mv(kvc_cells *c, uint32_t src, uint32_t dst)

    bint kvc_cells_pos_add_raw(kvc_cells *c, uint32_t i, int32_t d)
    void kvc_cells_pos_div_raw(kvc_cells *c, uint32_t i, int32_t d)
    void kvc_cells_set_raw(kvc_cells *c, uint32_t i, int32_t pos, uint64_t seq)
    void kvc_cells_clear_raw(kvc_cells *c, uint32_t i)
    void kvc_cells_rebuild_seq_pos(kvc_cells *c, uint64_t mask)
    void kvc_cells_seq_pos_rm_range(kvc_cells *c, int32_t s, int32_t p0, int32_t p1)

    int32_t kvc_cells_seq_pos_min(const kvc_cells *c, int32_t s)
    int32_t kvc_cells_seq_pos_max(const kvc_cells *c, int32_t s)

    uint32_t kvc_cells_next_used(const kvc_cells *c, uint32_t from_, uint32_t to)
    uint32_t kvc_cells_next_empty(const kvc_cells *c, uint32_t from_, uint32_t to)

    void kvc_cells_copy(kvc_cells *dst, const kvc_cells *src)
