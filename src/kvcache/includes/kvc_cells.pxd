# Declarations of csrc/kvc_cells.h: the cell table of a unified cache.
from libc.stdint cimport int32_t, uint16_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_pos_range

cdef extern from "kvc_seqset.h" nogil:
    enum:
        KVC_SEQ_WORDS
    ctypedef struct kvc_seqset:
        uint64_t w[4]
    uint32_t kvc_seq_words(uint32_t n_seq_max)
    int32_t kvc_seqset_next(const kvc_seqset *s, uint32_t nw, int32_t after)

cdef extern from "kvc_cells.h" nogil:
    enum:
        KVC_CELLS_NO_OWNER

    ctypedef struct kvc_seq_pos:
        uint64_t *key
        uint32_t n

    ctypedef struct kvc_cell_ext:
        int32_t x, y, tok

    ctypedef struct kvc_cells:
        uint32_t size
        uint32_t n_seq_max
        uint32_t n_words
        uint32_t seq_words
        int32_t *pos
        int32_t *shift
        uint64_t *seq           # the sets of the cells several sequences hold (0 elsewhere)
        uint16_t *owner         # the one sequence of a cell exactly one holds; else stale (kvc_cells_owner)
        uint64_t *used_bits
        uint32_t used
        uint32_t used_max_p1
        bint has_shift
        kvc_seq_pos *seq_pos
        kvc_cell_ext *ext

    int  kvc_cells_init(kvc_cells *c, uint32_t size, uint32_t n_seq_max)
    void kvc_cells_free(kvc_cells *c)
    void kvc_cells_reset(kvc_cells *c)
    void kvc_cells_reset_shift(kvc_cells *c)

    bint kvc_cells_is_empty(const kvc_cells *c, uint32_t i)
    bint kvc_cells_seq_has(const kvc_cells *c, uint32_t i, int32_t s)
    uint32_t kvc_cells_owner(const kvc_cells *c, uint32_t i)
    uint64_t kvc_cells_seq_word(const kvc_cells *c, uint32_t i, uint32_t w)
    void kvc_cells_seq_get(const kvc_cells *c, uint32_t i, uint64_t *out)
    int32_t kvc_cells_seq_next(const kvc_cells *c, uint32_t i, int32_t after)
    bint kvc_cells_seq_none(const kvc_cells *c, uint32_t i)
    bint kvc_cells_pos_in(const kvc_cells *c, uint32_t i, kvc_pos_range r)

    void kvc_cells_pos_set(kvc_cells *c, uint32_t i, int32_t p)
    void kvc_cells_seq_add(kvc_cells *c, uint32_t i, int32_t s)
    bint kvc_cells_seq_rm(kvc_cells *c, uint32_t i, int32_t s)
    void kvc_cells_mv(kvc_cells *c, uint32_t src, uint32_t dst)

    bint kvc_cells_pos_add_raw(kvc_cells *c, uint32_t i, int32_t d)
    void kvc_cells_pos_div_raw(kvc_cells *c, uint32_t i, int32_t d)
    void kvc_cells_set_raw(kvc_cells *c, uint32_t i, int32_t pos, const uint64_t *seq)
    bint kvc_cells_seq_del_raw(kvc_cells *c, uint32_t i, int32_t s)
    void kvc_cells_clear_raw(kvc_cells *c, uint32_t i)
    void kvc_cells_rebuild_seq_pos(kvc_cells *c, const kvc_seqset *mask)
    void kvc_cells_seq_pos_rm_range(kvc_cells *c, int32_t s, kvc_pos_range r)

    int32_t kvc_cells_seq_pos_min(const kvc_cells *c, int32_t s)
    int     kvc_cells_seq_cells(const kvc_cells *c, int32_t s, int32_t *cells, int32_t *pos)
    int32_t kvc_cells_seq_pos_max(const kvc_cells *c, int32_t s)

    uint32_t kvc_cells_next_used(const kvc_cells *c, uint32_t from_, uint32_t to)
    uint32_t kvc_cells_next_empty(const kvc_cells *c, uint32_t from_, uint32_t to)

    void kvc_cells_copy(kvc_cells *dst, const kvc_cells *src)
