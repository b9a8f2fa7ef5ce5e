/* kvcache — the sequence operations every cell table answers (the unified cache, kvc_unified.h,
 * and the recurrent cache, kvc_recurrent.h) as one table of signatures, so that a caller that
 * drives either (the Python bridge) declares and calls them once. Each cache defines its table
 * with KVC_SEQ_OPS_DEFINE in its .c file; the semantics of each operation are its cache's (see
 * the cache's header). The queries seq_pos_min / seq_pos_max are not here: they are inline in
 * the unified cache's header, and a call through a table would cost them that. */
#ifndef KVC_SEQOPS_H
#define KVC_SEQOPS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct kvc_seq_ops {
    void (*clear)(void *c);
    bool (*seq_rm)(void *c, int32_t s, int32_t p0, int32_t p1);
    void (*seq_cp)(void *c, int32_t src, int32_t dst, int32_t p0, int32_t p1);
    void (*seq_keep)(void *c, int32_t s);
    void (*seq_add)(void *c, int32_t s, int32_t p0, int32_t p1, int32_t shift);
    void (*seq_div)(void *c, int32_t s, int32_t p0, int32_t p1, int32_t d);
} kvc_seq_ops;

/* The table P_seq_ops of the cache type T whose operations are P_clear, P_seq_rm, ...: each entry
 * takes the cache as void * and calls the cache's own function. */
#define KVC_SEQ_OPS_DEFINE(P, T)                                                                   \
    static void P##_op_clear(void *c) { P##_clear((T *)c); }                                       \
    static bool P##_op_seq_rm(void *c, int32_t s, int32_t p0, int32_t p1) {                        \
        return P##_seq_rm((T *)c, s, p0, p1);                                                      \
    }                                                                                              \
    static void P##_op_seq_cp(void *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {         \
        P##_seq_cp((T *)c, src, dst, p0, p1);                                                      \
    }                                                                                              \
    static void P##_op_seq_keep(void *c, int32_t s) { P##_seq_keep((T *)c, s); }                   \
    static void P##_op_seq_add(void *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {        \
        P##_seq_add((T *)c, s, p0, p1, shift);                                                     \
    }                                                                                              \
    static void P##_op_seq_div(void *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {            \
        P##_seq_div((T *)c, s, p0, p1, d);                                                         \
    }                                                                                              \
    const kvc_seq_ops P##_seq_ops = { P##_op_clear,  P##_op_seq_rm,  P##_op_seq_cp,                \
                                      P##_op_seq_keep, P##_op_seq_add, P##_op_seq_div }

/* The operations a composite cache of type T passes to both of its parts unchanged: P_clear,
 * P_seq_keep, P_seq_add and P_seq_div call the part A (an expression of the composite c) through
 * the functions prefixed PA, then the part B through those prefixed PB. seq_rm and seq_cp, whose
 * parts may refuse, and the queries are each composite's own. */
#define KVC_SEQ_PAIR_DEFINE(P, T, PA, A, PB, B)                                                    \
    void P##_clear(T *c) {                                                                         \
        PA##_clear(A);                                                                             \
        PB##_clear(B);                                                                             \
    }                                                                                              \
    void P##_seq_keep(T *c, int32_t s) {                                                           \
        PA##_seq_keep(A, s);                                                                       \
        PB##_seq_keep(B, s);                                                                       \
    }                                                                                              \
    void P##_seq_add(T *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) {                     \
        PA##_seq_add(A, s, p0, p1, shift);                                                         \
        PB##_seq_add(B, s, p0, p1, shift);                                                         \
    }                                                                                              \
    void P##_seq_div(T *c, int32_t s, int32_t p0, int32_t p1, int32_t d) {                         \
        PA##_seq_div(A, s, p0, p1, d);                                                             \
        PB##_seq_div(B, s, p0, p1, d);                                                             \
    }

#endif
