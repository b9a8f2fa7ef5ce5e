/* Internal to the C core: whether the target has SSE2 (every x86-64), and its intrinsics. The
 * vector paths are optional; each has a scalar twin that defines what it computes. */
#ifndef KVC_SIMD_H
#define KVC_SIMD_H

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define KVC_HAVE_SSE2 1
#endif

#endif
