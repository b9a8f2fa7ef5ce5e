"""Bad input to the calls that drive two parts or read the caller's objects (a hybrid hand-off
header, a composite update, sequence ids, an output file, out= arrays): refused in the caller's
words, each argument read once, and nothing changed where the call fails."""
from __future__ import annotations

import io
import struct

import numpy as np
import pytest

import kvcache
import kvcache.statefile
from kvcache import StateError, UBatch


def test_a_hybrid_header_naming_huge_recurrent_rows_is_refused_before_any_memory_is_taken():
    hy = lambda: kvcache.HybridCache(32, 4, recurrent_layers=[0, 2], n_embd_k_gqa=4, n_embd_v_gqa=4,  # noqa: E731
                                     n_embd_r=8, n_seq_max=4)
    s, d = hy(), hy()
    assert s.find_slot(UBatch([0, 1, 2], [2], n_seq_tokens=3))
    h = bytearray(s.seq_export(2).header)
    n = struct.unpack_from("<I", h, 8)[0]
    off = 12 + n
    m = struct.unpack_from("<I", h, off)[0]
    rows = off + 4 + m + 8
    o, ln = struct.unpack_from("<QQ", h, rows + 16)
    struct.pack_into("<QQ", h, rows + 16, o, ln + (1 << 40))    # a terabyte of rows
    with pytest.raises(StateError, match="recurrent rows hold .* bytes, a cell of this cache's recurrent part 64"):
        d.seq_import_begin(bytes(h), 1)
    imp = d.seq_import_begin(s.seq_export(2).header, 1)         # the true header still begins
    imp.abort()


class Later(np.int64):
    """A numpy integer that is valid when first read and out of range after."""

    def __new__(cls, v):
        o = np.int64.__new__(cls, v)
        o.reads = 0
        return o

    def __index__(self):
        self.reads += 1
        return 65536 if self.reads == 1 else 2**40


def test_an_iswa_update_reads_its_node_budget_once():
    c = kvcache.ISWACache(32, 3, 4, 4, swa_layers=[0, 2], n_swa=4, n_batch=8, n_seq_max=4, n_pad=1, semantics="2026")
    assert c.find_slot(UBatch([0, 1, 2, 3, 4], [0], n_seq_tokens=5))
    c.seq_add(0, 0, -1, 2)
    c.update(n_max_nodes=Later(0))
    assert not c.base.has_shift and not c.swa.has_shift


@pytest.mark.parametrize("seq_id", [{0, 1, 2}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}.keys(), frozenset({1, 2, 3}),
                                    b"\x00\x01\x02", [0, {1, 2}, 2], [0, {1: 0}, 2]])
def test_sequence_ids_are_an_ordered_sequence(seq_id):
    with pytest.raises(TypeError, match="seq_id"):
        UBatch([0, 1, 2], seq_id)
    with pytest.raises(TypeError, match="seq_id"):
        kvcache.Batch([0, 1, 2], seq_id)


def test_a_recurrent_state_read_checks_convert_as_every_cache():
    r = kvcache.RecurrentCache(4, 1, 4, 4, semantics="2026")
    assert r.find_slot(UBatch([0], [0]))
    blob = r.state_write(-1)
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="convert"):
            r.state_read(blob, convert=bad)
    r.state_read(blob, convert=True)          # a recurrent state has nothing to convert


def test_find_slot_names_itself_once():
    r = kvcache.RecurrentCache(4, 1, 4, 4, semantics="2026")
    with pytest.raises(ValueError) as e:
        r.find_slot(UBatch([0, 1], [[0], [0]], 1))
    assert str(e.value).count("find_slot") <= 1


class Lying(io.RawIOBase):
    def __init__(self, answer):
        self.answer = answer

    def writable(self):
        return True

    def write(self, b):
        return self.answer(len(b))


@pytest.mark.parametrize("answer,err", [(lambda n: n + 1, OSError), (lambda n: 2**40, OSError),
                                        (lambda n: True, TypeError), (lambda n: 1.0 * n, TypeError)])
def test_a_file_whose_write_claims_what_it_was_not_given_is_an_error(answer, err):
    c = kvcache.UnifiedCache(32, 1, 4, 4, semantics="2026")
    assert c.find_slot(UBatch([0, 1], [0, 0]))
    with pytest.raises(err, match="write"):
        c.state_write_into(Lying(answer), -1)
    with pytest.raises(err, match="write"):
        kvcache.statefile.write_sequence_file(Lying(answer), c, 0, [5, 6])


def _placed():
    c = kvcache.UnifiedCache(64, 1, 4, 4, n_seq_max=4, semantics="2026")
    ub = UBatch([0, 1, 2], [0, 1, 2])
    assert c.find_slot(ub)
    return c, ub


def test_attention_indices_refuses_out_arrays_that_share_memory():
    c, ub = _placed()
    out = kvcache.AttentionIndices.buffers(4, 64)
    shared = out._replace(kv_indptr=out.qo_indptr)
    with pytest.raises(ValueError, match="out.kv_indptr and out.qo_indptr share memory"):
        c.attention_indices(ub, out=shared)
    view = out._replace(kv_indices=out.kv_indices, stream=out.kv_indices[10:20])
    with pytest.raises(ValueError, match="share memory"):
        c.attention_indices(ub, out=view)
    got = c.attention_indices(ub, out=out)
    assert got.qo_indptr.tolist() == [0, 1, 2, 3]


def test_attention_indices_answers_in_the_arrays_it_wrote():
    c, ub = _placed()
    out = kvcache.AttentionIndices.buffers(4, 64)
    written = {}

    class Shifty(kvcache.AttentionIndices):
        def __getattribute__(self, name):
            v = super().__getattribute__(name)
            if name in ("qo_indptr", "kv_indptr", "kv_indices", "causal", "stream"):
                if name in written:
                    return np.full_like(v, 77)      # another array when read again
                written[name] = v
            return v

    got = c.attention_indices(ub, out=Shifty(*out))
    assert got.qo_indptr.tolist() == [0, 1, 2, 3] and 77 not in got.kv_indices


def test_a_hybrid_header_whose_recurrent_position_was_changed_is_refused():
    hy = lambda: kvcache.HybridCache(32, 4, recurrent_layers=[0, 2], n_embd_k_gqa=4, n_embd_v_gqa=4,  # noqa: E731
                                     n_embd_r=8, n_seq_max=4)
    s, d = hy(), hy()
    assert s.find_slot(UBatch([0, 1, 2, 3], [2], n_seq_tokens=4))
    h = bytearray(s.seq_export(2).header)
    n = struct.unpack_from("<I", h, 8)[0]
    sk = 12 + n + 4
    refused = 0
    for at in range(sk, sk + 32):          # the recurrent state's cell and position fields
        bad = bytearray(h)
        bad[at] ^= 0x20
        before = d.state_write(-1)
        try:
            imp = d.seq_import_begin(bytes(bad), 1)
        except StateError:
            refused += 1
            assert d.state_write(-1) == before
            continue
        imp.commit()
        # what went in agrees with itself: the recurrent state stands where the cells end
        assert d.recr.seq_pos_max(1) == d.attn.seq_pos_max(1) == 3
        d.seq_rm(1)
    assert refused > 0
