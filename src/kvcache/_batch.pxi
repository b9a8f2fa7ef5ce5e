# _batch: the batch splitter (csrc/kvc_batch.h) — one batch in, ubatches out.

from libc.stdint cimport int8_t, int64_t, UINT32_MAX
from kvcache.includes.kvc_batch cimport *

_SPLIT_MODES = {"simple": KVC_SPLIT_SIMPLE, "equal": KVC_SPLIT_EQUAL, "seq": KVC_SPLIT_SEQ}


cdef uint32_t _as_n_ubatch(object n_ubatch) except? 0:
    # any size beyond the batch takes as much as a size equal to it
    return <uint32_t>min(int_c(n_ubatch, "n_ubatch", 1, LLONG_MAX), <long long>UINT32_MAX)


cdef class SplitUBatch(UBatch):
    """A :class:`UBatch` produced by :class:`Batch`: it also knows which batch tokens it holds.

    ``ids[i]`` is the index in the batch of the ubatch's i-th token (use it to gather token ids
    or embeddings); ``equal_seqs`` is False for a simple split."""
    cdef readonly object ids        # int64[n_tokens]: batch index of each token, in ubatch order
    cdef readonly bint equal_seqs   # False for a simple split

    def __repr__(self):
        return (f"SplitUBatch(n_tokens={self.c.n_tokens}, n_seq_tokens={self.c.n_seq_tokens}, "
                f"n_seqs={self.c.n_seqs}, equal_seqs={bool(self.equal_seqs)})")


cdef class Batch:
    """A batch of tokens cut into ubatches the way llama.cpp's decoder does.

    ``Batch(pos, seq_id, output=None, logits_all=False, simple_split=True, *, tokens=None,
    pos_x=None, pos_y=None)``

    - ``pos``: one position per token (ints in [0, 2**31)).
    - ``seq_id``: one entry per token, an int or a non-empty list of ints in [0, MAX_SEQ = 256).
    - ``output``: optional per-token output flags (bools or ints); without them only the last
      token of the batch is an output; ``logits_all=True`` makes every token one.
    - ``simple_split``: keep the batch in its order for :meth:`split_simple`; with False the
      tokens are grouped by sequence for :meth:`split_equal` / :meth:`split_seq`.
    - ``tokens``, ``pos_x``, ``pos_y``: optional token ids and 2-D positions, one per token, as
      :class:`UBatch` takes them; each split carries those of its tokens.

    Each split returns the next :class:`SplitUBatch` (a :class:`UBatch`) or None once every
    token has been placed; :attr:`out_ids` lists the output tokens in the order they were
    placed, which is the order of the output rows a model computes.
    """
    cdef kvc_sbatch c               # the splitter (owns copies of the batch and the last ubatch)
    cdef kvc_lock _lock             # held while splitting and reading the split state
    cdef object _ext                # the checked tokens / 2-D positions (see _ext_values), or None

    __signature__ = _signatures.ClassSignature(_signatures.batch)

    def __cinit__(self, *args, **kwargs):
        pos, seq_id, output, logits_all, simple_split, tokens, pos_x, pos_y = _signatures.bind(
            _signatures.batch, type(self), args, kwargs)
        cdef kvc_err err
        cdef int rc
        cdef Py_ssize_t n_tokens, t, k
        err.msg[0] = 0
        if kvc_lock_init(&self._lock, NULL) != 0:
            raise MemoryError("Batch: cannot allocate its lock")
        pos64 = values_c(pos, "pos", VALUES_INT)
        n_tokens = pos64.shape[0]
        if n_tokens >= UINT32_MAX:
            raise ValueError(f"too many tokens ({n_tokens})")
        if n_tokens and (pos64.min() < 0 or pos64.max() > INT32_MAX):
            k = int(np.flatnonzero((pos64 < 0) | (pos64 > INT32_MAX))[0])
            _ints_refuse(pos64[k], k, INT32_MAX, "pos")
        lists = seq_lists_c(seq_id, n_tokens, "token")
        self._ext = None
        if tokens is not None or pos_x is not None or pos_y is not None:
            self._ext = _ext_values(tokens, pos_x, pos_y, n_tokens)
        logits_arr = None
        if output is not None:
            out_arr = values_c(output, "output", VALUES_FLAG)
            if out_arr.shape != (n_tokens,):
                raise ValueError(f"output must have one flag per token ({n_tokens}), got shape {out_arr.shape}")
            logits_arr = np.ascontiguousarray(out_arr != 0, dtype=np.int8)
        all_ = bool_arg(logits_all, "logits_all")
        simple = bool_arg(simple_split, "simple_split")

        pos32 = pos64.astype(np.int32)
        off = np.zeros(n_tokens + 1, dtype=np.uint32)
        off[1:] = np.cumsum([len(l) for l in lists], dtype=np.uint64) if n_tokens else 0
        flat = np.fromiter((x for l in lists for x in l), dtype=np.int32, count=int(off[n_tokens]))
        flat = np.ascontiguousarray(flat) if flat.size else np.zeros(1, dtype=np.int32)
        if n_tokens == 0:
            pos32 = np.zeros(1, dtype=np.int32)
        cdef int32_t[::1] pos_v = pos32
        cdef uint32_t[::1] off_v = off
        cdef int32_t[::1] ids_v = flat
        cdef int8_t[::1] logits_v
        cdef const int8_t *logits_p = NULL
        cdef bint c_all = all_, c_simple = simple
        if logits_arr is not None:
            if n_tokens == 0:
                logits_arr = np.zeros(1, dtype=np.int8)
            logits_v = logits_arr
            logits_p = &logits_v[0]
        cdef uint32_t n = <uint32_t>n_tokens
        with nogil:
            rc = kvc_sbatch_init(&self.c, n, &pos_v[0], &off_v[0], &ids_v[0], logits_p, c_all, c_simple, &err)
        check_status(rc, &err, "invalid batch")

    def __dealloc__(self):
        kvc_sbatch_free(&self.c)
        kvc_lock_free(&self._lock)

    @property
    def n_tokens(self) -> int:
        """Number of tokens in the batch."""
        return self.c.n_tokens

    @property
    def n_tokens_left(self) -> int:
        """Tokens not yet placed into a ubatch."""
        cdef uint32_t r
        lock(&self._lock, READ, "n_tokens_left")
        try:
            r = self.c.n_left
        finally:
            unlock(&self._lock, READ)
        return r

    @property
    def simple_split(self) -> bool:
        """True when built for :meth:`split_simple`, False for the sequence-aware splits."""
        return self.c.simple_split

    @property
    def logits_all(self) -> bool:
        """True when every token is an output."""
        return self.c.logits_all

    @property
    def out_ids(self):
        """Batch indices of the output tokens placed so far, in placement order (int64 array)."""
        cdef Py_ssize_t i
        cdef int64_t[::1] v
        lock(&self._lock, RUNS_PYTHON, "out_ids")
        try:
            res = np.empty(self.c.n_out, dtype=np.int64)
            v = res
            for i in range(self.c.n_out):
                v[i] = self.c.out_ids[i]
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return res

    def __len__(self):
        return self.c.n_tokens

    def __repr__(self):
        return (f"Batch(n_tokens={self.c.n_tokens}, n_tokens_left={self.n_tokens_left}, "
                f"simple_split={bool(self.c.simple_split)}, logits_all={bool(self.c.logits_all)})")

    cdef object _split(self, kvc_split_mode mode, object n_ubatch):
        cdef kvc_err err
        cdef kvc_sbatch_ubatch out
        cdef uint32_t n = _as_n_ubatch(n_ubatch)
        cdef uint32_t i, g
        cdef int rc
        cdef uint32_t n_tok
        cdef int32_t[::1] pos_v
        cdef int64_t[::1] ids_v
        cdef uint8_t[::1] out_v
        err.msg[0] = 0
        # the split and the copy of its result (which lives in the splitter) under the lock
        lock(&self._lock, RUNS_PYTHON | CHANGE, "split")
        try:
            rc = kvc_sbatch_split(&self.c, mode, n, &out, &err)
            check_status(rc, &err, "cannot split")
            if rc == 0:
                return None
            n_tok = out.ub.n_tokens
            pos = np.empty(n_tok, dtype=np.int32)
            ids = np.empty(n_tok, dtype=np.int64)
            output = np.empty(n_tok, dtype=bool)
            pos_v = pos
            ids_v = ids
            out_v = output.view(np.uint8)
            for i in range(n_tok):
                pos_v[i] = out.ub.pos[i]
                ids_v[i] = out.token[i]
                out_v[i] = out.output[i] != 0
            groups = [[out.ub.seq_ids[i] for i in range(out.ub.seq_off[g], out.ub.seq_off[g + 1])]
                      for g in range(out.ub.n_seqs)]
            n_seq_tokens = out.ub.n_seq_tokens
            equal_seqs = out.equal_seqs
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)
        ext = {}
        if self._ext is not None:
            vals, (has_xy, has_tok) = self._ext
            if has_xy:
                ext.update(pos_x=vals[0][ids], pos_y=vals[1][ids])
            if has_tok:
                ext["tokens"] = vals[2][ids]
        cdef SplitUBatch ub = SplitUBatch(pos, groups, n_seq_tokens, output, **ext)
        ub.ids = ids
        ub.equal_seqs = equal_seqs
        return ub

    def split_simple(self, n_ubatch):
        """The next ``n_ubatch`` tokens (fewer at the end) in batch order, one group per token;
        None when the batch is exhausted. Needs ``simple_split=True``."""
        return self._split(KVC_SPLIT_SIMPLE, n_ubatch)

    def split_equal(self, n_ubatch):
        """Up to ``n_ubatch`` tokens as equal-length slices of several sequence groups (a group
        shared by several sequences goes alone); None when exhausted. Needs ``simple_split=False``."""
        return self._split(KVC_SPLIT_EQUAL, n_ubatch)

    def split_seq(self, n_ubatch):
        """Up to ``n_ubatch`` tokens of one sequence group; None when exhausted.
        Needs ``simple_split=False``."""
        return self._split(KVC_SPLIT_SEQ, n_ubatch)

    def ubatches(self, n_ubatch, mode=None):
        """Iterate over the remaining ubatches of at most ``n_ubatch`` tokens.

        ``mode`` is ``"simple"``, ``"equal"`` or ``"seq"``; by default ``"simple"`` for a batch
        built with ``simple_split=True`` and ``"equal"`` otherwise."""
        if mode is None:
            mode = "simple" if self.c.simple_split else "equal"
        if mode not in _SPLIT_MODES:
            raise ValueError(f"mode must be one of {sorted(_SPLIT_MODES)}, got {mode!r}")
        c_mode = _SPLIT_MODES[mode]
        if (c_mode == KVC_SPLIT_SIMPLE) != self.c.simple_split:
            raise ValueError(f"mode {mode!r} does not fit a batch built with simple_split={bool(self.c.simple_split)}")
        _as_n_ubatch(n_ubatch)
        return self._iter_ubatches(c_mode, n_ubatch)

    def _iter_ubatches(self, c_mode, n_ubatch):
        while True:
            ub = self._split(c_mode, n_ubatch)
            if ub is None:
                return
            yield ub
