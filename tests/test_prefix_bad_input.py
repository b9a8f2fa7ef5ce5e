"""Bad input to the prefix-reuse calls of every cache kind: a clear exception, never a crash, and
a call that fails changes nothing, in either part of a composite cache (iSWA, hybrid). Composite
calls read each argument once, so an argument that answers differently when read again (an
integer whose __index__ changes, an iterable that yields other tokens) cannot reach the two parts
as two different requests."""
from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import UBatch

PROMPT = [1, 2, 3, 4, 5, 6]


def unified():
    c = kvcache.UnifiedCache(64, 1, 4, 4, n_seq_max=4, semantics="2026")
    c.enable_prefix_reuse()
    return c


def iswa():
    c = kvcache.ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=4, n_seq_max=3, semantics="2026")
    c.enable_prefix_reuse()
    return c


def hybrid():
    c = kvcache.HybridCache(64, 2, [1], 4, 4, 4, 4, n_seq_max=4)
    c.enable_prefix_reuse()
    return c


def recurrent():
    c = kvcache.RecurrentCache(4, 1, 4, 4, semantics="2026")
    c.enable_prefix_reuse()
    return c


def released(make):
    """A cache holding PROMPT in its index (and, for the hybrid memory, its final checkpoint)."""
    c = make()
    if make is hybrid:
        c.find_slot(UBatch(list(range(6)), [0], n_seq_tokens=6, tokens=PROMPT))
        c.prefix_release(0, PROMPT)
    else:
        c.find_slot(UBatch(list(range(6)), [0] * 6, tokens=PROMPT))
        c.prefix_release(0)
    return c


def check(c):
    """The index agrees with the cells, in every part."""
    for part in (c.base, c.swa) if isinstance(c, kvcache.ISWACache2026) else (c,):
        part._prefix_check()


class Flip(np.int64):
    """A numpy integer whose __index__ answers differently each time it is asked."""
    answers: list = []

    def __index__(self):
        return Flip.answers.pop(0) if Flip.answers else 0


class Shifting:
    """Tokens that are other tokens each time they are iterated."""

    def __init__(self, *lists):
        self.lists = list(lists)

    def __iter__(self):
        return iter(self.lists.pop(0))

    def __len__(self):
        return len(self.lists[0])


@pytest.mark.parametrize("make", [unified, iswa, hybrid, recurrent])
def test_a_sequence_id_of_none_is_refused(make):
    c = make()
    calls = [lambda: c.prefix_attach(None, [1, 2, 3]), lambda: c.prefix_release(None, [1, 2, 3])]
    if hasattr(c, "prefix_publish"):
        calls.append(lambda: c.prefix_publish(None))
    for call in calls:
        with pytest.raises(TypeError, match="seq_id must be an int, not NoneType"):
            call()
    check(c)


def test_a_huge_sequence_id_is_named_against_the_sequences():
    c = unified()
    with pytest.raises(ValueError, match=r"seq_id = 9223372036854775808 is outside \[0, 4\)"):
        c.prefix_attach(2**63, [1, 2, 3])
    with pytest.raises(ValueError, match=r"seq_id = -5 is outside \[0, 4\)"):
        c.prefix_release(-5)


def test_a_refused_value_is_the_one_named():
    c = released(unified)
    Flip.answers = [-3, 7]
    with pytest.raises(ValueError, match=r"n_cells = -3 is outside"):
        c.prefix_evict(Flip(0))


@pytest.mark.parametrize("tokens", [b"\x01\x02\x03\x04", bytearray(b"\x01\x02\x03"), {3: 0, 1: 0, 2: 0},
                                    {3, 1, 2}, frozenset({1, 2})])
def test_bytes_sets_and_mappings_are_not_token_lists(tokens):
    c = released(unified)
    before = c.prefix_stats
    for call in (lambda: c.prefix_match(tokens), lambda: c.prefix_attach(1, tokens), lambda: c.prefix_pin(tokens)):
        with pytest.raises(TypeError, match="tokens must be a sequence of integers or an array"):
            call()
    with pytest.raises(TypeError, match="pos must be a sequence of integers or an array"):
        UBatch(tokens, [0] * 3)
    assert c.prefix_stats == before


def test_iswa_unpin_checks_both_halves_before_letting_either_go():
    c = released(iswa)
    pin = c.prefix_pin([1, 2, 3])
    pinned = c.prefix_stats
    for bad in ((pin[0], 12345), (pin[0], -1), (pin[1] + 999, pin[1])):
        with pytest.raises(ValueError):
            c.prefix_unpin(bad)
        assert c.prefix_stats == pinned
    with pytest.raises(TypeError, match="pin must be a pin prefix_pin returned"):
        c.prefix_unpin(pin[0])
    with pytest.raises(TypeError):
        c.prefix_unpin((pin[0], "x"))
    Flip.answers = [pin[1], 777]
    c.prefix_unpin((pin[0], Flip(0)))       # read once: the value it gave first is the pin
    assert c.prefix_stats["base"]["evictable"] == c.prefix_stats["base"]["cells"]
    assert c.prefix_stats["swa"]["evictable"] == c.prefix_stats["swa"]["cells"]
    check(c)


def test_iswa_evict_reads_its_count_once():
    c = released(iswa)
    before = c.prefix_stats
    Flip.answers = [3, -1]
    went = c.prefix_evict(Flip(0))             # 3 asked of each cache (a prefix goes whole)
    after = c.prefix_stats
    assert went == 12 and after["base"]["cells"] == after["swa"]["cells"] == before["base"]["cells"] - 6


@pytest.mark.parametrize("make", [iswa, hybrid])
def test_a_composite_pin_pins_one_request_in_both_parts(make):
    c = released(make)
    pin = c.prefix_pin(Shifting([1, 2, 3, 4, 5, 6], [9, 9, 9]))
    c.prefix_unpin(pin)                        # both halves name the same prefix: both let go
    check(c)


@pytest.mark.parametrize("make", [iswa, hybrid])
def test_a_composite_pin_refused_in_one_part_pins_nothing(make):
    c = released(make)
    before = c.prefix_stats
    with pytest.raises(ValueError):
        c.prefix_pin([1, 2, 3, 9])
    assert c.prefix_stats == before


def test_hybrid_evict_checks_both_counts_before_evicting():
    c = released(hybrid)
    before = c.prefix_stats
    for bad in (-1, "x", 1.0, 2**40):
        with pytest.raises((TypeError, ValueError)):
            c.prefix_evict(100, bad)
        with pytest.raises((TypeError, ValueError)):
            c.prefix_evict(bad, 1)
        assert c.prefix_stats == before


def test_hybrid_enable_with_a_bad_cap_keeps_what_it_had():
    c = released(hybrid)
    before, held = c.prefix_stats, c.recr.prefix_checkpoints()
    for bad in (-1, "x", 2**40):
        with pytest.raises((TypeError, ValueError)):
            c.enable_prefix_reuse(cap=bad)
        assert c.prefix_reuse and c.prefix_stats == before and c.recr.prefix_checkpoints() == held


def test_hybrid_unpin_checks_both_halves_before_letting_either_go():
    c = released(hybrid)
    pin = c.prefix_pin(PROMPT)
    pinned = c.prefix_stats
    for bad in ((pin[0], pin[1] + 12345), (pin[0] + 999, pin[1])):
        with pytest.raises(ValueError):
            c.prefix_unpin(bad)
        assert c.prefix_stats == pinned
    with pytest.raises(TypeError, match="pin must be a pin prefix_pin returned"):
        c.prefix_unpin(pin[0])
    Flip.answers = [pin[1], 4321]
    c.prefix_unpin((pin[0], Flip(0)))
    assert c.prefix_stats["recr"]["pinned"] == 0
    check(c)


def test_iswa_with_reuse_off_says_so_as_every_cache():
    c = kvcache.ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=4, n_seq_max=3, semantics="2026")
    for call in (lambda: c.prefix_attach(0, [1, 2]), lambda: c.prefix_release(0), lambda: c.prefix_publish(0),
                 lambda: c.prefix_pin([1, 2]), lambda: c.prefix_evict(1), lambda: c.prefix_unpin((1, 1))):
        with pytest.raises(RuntimeError, match="prefix reuse is off"):
            call()
