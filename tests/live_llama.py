"""What the live tests of both llama-cpp-python versions do the same way through llama_cpp's
low-level API: decoding a batch and moving state bytes through ctypes buffers. The subclasses
(test_interop.Llama for 0.3.10, test_live_v10.Live for 0.3.36) make the contexts and replay the
scripts, which the two versions do differently."""
import ctypes

import numpy as np


class LlamaCalls:
    """Needs ``self.L`` (the llama_cpp module) and ``self.n_vocab``."""

    def decode(self, ctx, tokens):
        """Decode [(token, pos, [seq ids]), ...]; the logits of the last token (a copy)."""
        L = self.L
        b = L.llama_batch_init(len(tokens), 0, 4)
        try:
            b.n_tokens = len(tokens)
            for i, (t, p, seqs) in enumerate(tokens):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, p, len(seqs)
                for k, s in enumerate(seqs):
                    b.seq_id[i][k] = s
                b.logits[i] = i == len(tokens) - 1
            assert L.llama_decode(ctx, b) == 0
        finally:
            L.llama_batch_free(b)
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)).copy()

    def seq_get(self, ctx, seq_id) -> bytes:
        L = self.L
        n = L.llama_state_seq_get_size(ctx, seq_id)
        buf = (ctypes.c_uint8 * n)()
        assert L.llama_state_seq_get_data(ctx, buf, n, seq_id) == n
        return bytes(buf)

    def seq_set(self, ctx, data: bytes, seq_id) -> int:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return self.L.llama_state_seq_set_data(ctx, buf, len(data), seq_id)

    def state_get(self, ctx) -> bytes:
        L = self.L
        n = L.llama_state_get_size(ctx)
        buf = (ctypes.c_uint8 * n)()
        assert L.llama_state_get_data(ctx, buf, n) == n
        return bytes(buf)

    def state_set(self, ctx, data: bytes) -> int:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return self.L.llama_state_set_data(ctx, buf, len(data))

    def decode_embd(self, ctx, items):
        """Decode embeddings, as a multimodal chunk: [(vector, positions, [seq ids]), ...] with one
        position per plane (an M-RoPE model's 4: sequential, y, x, other), which llama.cpp reads
        plane by plane (n_tokens positions each); the logits of the last one (a copy)."""
        L = self.L
        n, planes = len(items), len(items[0][1])
        embd = np.ascontiguousarray([v for v, _, _ in items], dtype=np.float32)
        pos = (ctypes.c_int32 * (n * planes))(*[p[j] for j in range(planes) for _, p, _ in items])
        ids = [(ctypes.c_int32 * len(s))(*s) for _, _, s in items]
        b = L.llama_batch()
        b.n_tokens = n
        b.embd = embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = ctypes.cast(pos, b.pos.__class__)   # the arrays above live until the call returns
        b.n_seq_id = (ctypes.c_int32 * n)(*[len(s) for _, _, s in items])
        b.seq_id = (ctypes.POINTER(ctypes.c_int32) * n)(*[ctypes.cast(a, ctypes.POINTER(ctypes.c_int32)) for a in ids])
        b.logits = (ctypes.c_int8 * n)(*[i == n - 1 for i in range(n)])
        assert L.llama_decode(ctx, b) == 0
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)).copy()
