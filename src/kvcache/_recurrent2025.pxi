# The recurrent cache of llama.cpp as of mid-2025 (semantics "2025", llama_kv_cache_recurrent):
# s_copy and s_mask move the cells' sources in place.


cdef class _Recurrent2025(_Recurrent):
    """The mid-2025 recurrent cache (kvcache.RecurrentCache2025 is the documented public class)."""

    __signature__ = _signatures.ClassSignature(_signatures.recurrent)   # semantics None: "2025"

    def s_mask(self):
        """float32[n]: for cells head + i, 1.0 when the state is kept, 0.0 when it starts from
        zero. Updates the cells' sources in place as the reference does (zeroed once)."""
        cdef float[::1] o
        cdef int r = 0
        lock(&self._lock, RUNS_PYTHON | CHANGE, "s_mask")
        try:
            out = np.empty(self.c.cells.n, dtype=np.float32)
            if self.c.cells.n:
                o = out
                with nogil:
                    r = kvc_recurrent_s_mask(&self.c, self.c.cells.n, &o[0])
                check_status(r, NULL, f"s_mask: head {self.c.cells.head} + n {self.c.cells.n} passes the last cell")
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)
        return out
