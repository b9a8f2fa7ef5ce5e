# cython: language_level=3
"""kvcache._core: the Cython bridge over the C core in csrc/.

One module assembled from one .pxi per concept (the file tree is the architecture):
arguments are validated once here, then C does the work, with the GIL released in
long loops. The cimport-able contract is _core.pxd: C-level methods of UnifiedCore and
RecurrentCore (implemented by the private _Unified2025 / _Unified2026 and _Recurrent2025 / _Recurrent2026)
and UBatch."""

include "_common.pxi"
include "_buffers.pxi"
include "_state.pxi"
include "_framing.pxi"
include "_rope.pxi"
include "_unified_support.pxi"
include "_spill.pxi"
include "_unified.pxi"
include "_unified2025.pxi"
include "_unified2026.pxi"
include "_attn.pxi"
include "_batch.pxi"
include "_recurrent.pxi"
include "_recurrent2025.pxi"
include "_recurrent2026.pxi"
include "_parts.pxi"
include "_iswa.pxi"
include "_iswa2025.pxi"
include "_iswa2026.pxi"
include "_hybrid.pxi"
include "_handoff.pxi"
include "_store.pxi"
