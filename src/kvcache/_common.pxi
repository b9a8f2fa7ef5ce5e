# Shared pieces of the bridge: status -> exception mapping and the UBatch class.

from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t, INT32_MAX
from libc.string cimport memcpy
from kvcache.includes.kvc_common cimport *

import numpy as np


MAX_SEQ = KVC_MAX_SEQ
"""Sequence ids a cache can hold are below this (llama.cpp's LLAMA_MAX_SEQ): n_seq_max <= MAX_SEQ."""


class StateError(ValueError):
    """A state blob is malformed, truncated or does not fit this cache.

    The cache is left exactly as it was before the failed read."""


cdef int raise_status(int status, kvc_err *err, str what) except -1:
    """Turn a negative C status into the matching Python exception."""
    cdef str msg = what
    if err != NULL and err.msg[0] != 0:
        msg = f"{what}: {err.msg.decode('utf-8', 'replace')}"
    if status == KVC_E_NOMEM:
        raise MemoryError(msg)
    if status == KVC_E_STATE:
        raise StateError(msg)
    if status == KVC_E_ARG:
        raise ValueError(msg)
    if status == KVC_E_NOSPACE:
        raise ValueError(msg)
    raise RuntimeError(f"{msg} (internal error {status})")


cdef inline int check_status(int status, kvc_err *err, str what) except -1:
    if status < 0:
        raise_status(status, err, what)
    return 0


# --- the ggml type table, read-only (csrc/kvc_types.h is the one copy) ---------------------------

from collections import namedtuple as _namedtuple

GGMLType = _namedtuple("GGMLType", "id name blck_size type_size")
GGMLType.__doc__ = "A ggml tensor type: id, name, elements per block, bytes per block."


def ggml_types():
    """The ggml types a cache can hold, by ascending id: a tuple of GGMLType."""
    cdef size_t i
    cdef const kvc_type_info *t
    found = []
    for i in range(kvc_type_count()):
        t = kvc_type_at(i)
        found.append(GGMLType(t.id, t.name.decode("ascii"), t.blck_size, t.type_size))
    return tuple(sorted(found))


def ggml_type(t):
    """The GGMLType of a type given by name ("f16", "Q8_0", ...) or ggml id (ValueError if unknown)."""
    cdef const kvc_type_info *info = NULL
    if isinstance(t, str):
        info = kvc_type_by_name(t.lower().encode("ascii", "replace"))
    elif isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)):
        if -2**31 <= t < 2**31:
            info = kvc_type_get(<int32_t>t)
    else:
        raise TypeError(f"a ggml type is a name such as 'f16' or an id, not {type(t).__name__}")
    if info == NULL:
        names = ", ".join(x.name for x in ggml_types())
        raise ValueError(f"unknown ggml type {t!r} (supported: {names})")
    return GGMLType(info.id, info.name.decode("ascii"), info.blck_size, info.type_size)


def ggml_row_size(t, n):
    """Bytes of a row of n elements of type t (name or id), as ggml_row_size.

    ValueError when n is negative or not a whole number of the type's blocks."""
    info = ggml_type(t)
    if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)):
        raise TypeError(f"n must be an int, not {type(n).__name__}")
    if n < 0 or n >= 2**63:
        raise ValueError(f"n = {n} must be in [0, 2**63)")
    if n % info.blck_size:
        raise ValueError(f"{info.name} rows hold whole blocks of {info.blck_size} elements; {n} is not a multiple")
    return kvc_row_size(info.id, <uint64_t>n)


cdef int32_t as_pos(object v, str name) except? -1:
    """A position argument as int32 (TypeError / ValueError naming the argument)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if v > INT32_MAX or v < -2147483648:
        raise ValueError(f"{name} = {v} is outside int32")
    return <int32_t>v


cdef class UBatch:
    """A ubatch: the tokens placed into a cache in one step.

    ``UBatch(pos, seq_id, n_seq_tokens=1, output=None)``

    - ``pos``: one position per token (ints in [0, 2**31)).
    - ``seq_id``: one entry per token group; an entry is an int or a list of ints (the first id
      of a group is the one its mask rows use). With ``n_seq_tokens == 1`` (simple split) every
      token is its own group; otherwise the tokens are ``len(seq_id)`` groups of
      ``n_seq_tokens`` consecutive tokens (equal split).
    - ``output``: optional per-token output flags (kept for the caller; caches ignore them).

    Read-only attributes: ``n_tokens``, ``n_seq_tokens``, ``n_seqs``, ``pos``, ``seq_id``,
    ``output`` (bool array or None) and ``max_seq`` (the largest sequence id, -1 when none).
    """

    def __cinit__(self, pos, seq_id, n_seq_tokens=1, output=None):
        cdef Py_ssize_t n_tokens, n_groups, g, j, total
        pos_arr = np.asarray(pos)
        if pos_arr.size and not np.issubdtype(pos_arr.dtype, np.integer):
            raise TypeError(f"pos must hold integers, got dtype {pos_arr.dtype}")
        if pos_arr.ndim != 1:
            raise ValueError(f"pos must be one-dimensional, got shape {pos_arr.shape}")
        n_tokens = pos_arr.shape[0]
        if n_tokens and (pos_arr.min() < 0 or pos_arr.max() > INT32_MAX):
            raise ValueError("pos values must lie in [0, 2**31 - 1]")
        if not isinstance(n_seq_tokens, (int, np.integer)) or n_seq_tokens < 1:
            raise ValueError(f"n_seq_tokens must be a positive int, got {n_seq_tokens!r}")
        if isinstance(seq_id, np.ndarray):
            seq_id = seq_id.tolist()
        try:
            groups = list(seq_id)
        except TypeError:
            raise TypeError("seq_id must be a sequence (one entry per token group)") from None
        n_groups = len(groups)
        if n_groups * n_seq_tokens != n_tokens:
            raise ValueError(f"seq_id has {n_groups} groups of n_seq_tokens={n_seq_tokens} tokens, "
                             f"but pos has {n_tokens} tokens")
        lists = []
        total = 0
        for g in range(n_groups):
            e = groups[g]
            if isinstance(e, (int, np.integer)) and not isinstance(e, bool):
                ids = [int(e)]
            else:
                if isinstance(e, (str, bytes, bool)):
                    raise TypeError(f"seq_id[{g}] must be an int or a list of ints, not {type(e).__name__}")
                try:
                    ids = list(e)
                except TypeError:
                    raise TypeError(f"seq_id[{g}] must be an int or a list of ints") from None
                for x in ids:
                    if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
                        raise TypeError(f"seq_id[{g}] holds {x!r}, not an int")
                ids = [int(x) for x in ids]
            if not ids:
                raise ValueError(f"seq_id[{g}] is empty: every token needs a sequence id")
            for x in ids:
                if x < 0 or x >= KVC_MAX_SEQ:
                    raise ValueError(f"seq_id[{g}] holds {x}, outside [0, {KVC_MAX_SEQ})")
            lists.append(ids)
            total += len(ids)
        self._pos = np.ascontiguousarray(pos_arr, dtype=np.int32)
        self._seq_off = np.zeros(n_groups + 1, dtype=np.uint32)
        self._seq_ids = np.zeros(max(total, 1), dtype=np.int32)
        cdef uint32_t[::1] off = self._seq_off
        cdef int32_t[::1] ids_v = self._seq_ids
        total = 0
        for g in range(n_groups):
            for x in lists[g]:
                ids_v[total] = x
                total += 1
            off[g + 1] = total
        self._seq_lists = lists
        self.output = None if output is None else np.asarray(output, dtype=bool)
        if self.output is not None and self.output.shape != (n_tokens,):
            raise ValueError(f"output must have one flag per token ({n_tokens}), got shape {self.output.shape}")
        cdef int32_t[::1] pos_v = self._pos
        self.c.n_tokens = <uint32_t>n_tokens
        self.c.n_seq_tokens = <uint32_t>n_seq_tokens
        self.c.n_seqs = <uint32_t>n_groups
        self.c.pos = &pos_v[0] if n_tokens else NULL
        self.c.seq_off = &off[0]
        self.c.seq_ids = &ids_v[0]
        self.max_seq = max((max(l) for l in lists), default=-1)

    @property
    def n_tokens(self) -> int:
        """Number of tokens."""
        return self.c.n_tokens

    @property
    def n_seq_tokens(self) -> int:
        """Tokens per group (1 for a simple split)."""
        return self.c.n_seq_tokens

    @property
    def n_seqs(self) -> int:
        """Number of token groups."""
        return self.c.n_seqs

    @property
    def pos(self):
        """Positions (int32 array, read-only view)."""
        v = self._pos.view()
        v.flags.writeable = False
        return v

    @property
    def seq_id(self):
        """Sequence ids of each group (list of lists)."""
        return [list(l) for l in self._seq_lists]

    def __len__(self):
        return self.c.n_tokens

    def __repr__(self):
        return f"UBatch(n_tokens={self.c.n_tokens}, n_seq_tokens={self.c.n_seq_tokens}, n_seqs={self.c.n_seqs})"

    cdef int check(self, uint32_t n_seq_max) except -1:
        """Check the ids against a cache's n_seq_max (ValueError naming the bad id)."""
        cdef kvc_err err
        err.msg[0] = 0
        if self.max_seq >= <int>n_seq_max:
            raise ValueError(f"seq_id {self.max_seq} in the ubatch is outside [0, {n_seq_max})")
        check_status(kvc_ubatch_check(&self.c, n_seq_max, &err), &err, "invalid ubatch")
        return 0


def _fail_alloc_after(n=None):
    """Test hook of the C core: make its n-th allocation from now on fail (once); 0 disarms
    it, None leaves it as it is. Returns the count pending before the call: 0 once the armed
    allocation was reached, > 0 when fewer allocations happened since it was armed.

    For tests that run one thread: the count is a plain global of the C core."""
    global kvc_fail_alloc_after
    cdef int old = kvc_fail_alloc_after
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, not {type(n).__name__}")
        if not 0 <= n <= 0x7FFFFFFF:
            raise ValueError(f"n = {n} is outside [0, 2**31)")
        kvc_fail_alloc_after = <int>n
    return old
