"""A blob's framings (kvcache._core.state_framings, csrc/kvc_framing.c), what inspect reports of it
and how state_read finds its layout, held against the answers recorded before these moved into one
C framing (tests/data/framing_answers.json.gz, from the Python walks they replace): the same
framings, the same reasons for each framing a blob is not, the same reports and the same reads or
errors, on every input of tests/framing_inputs.py (real states of every layout and cache kind,
cut, extended, doubled and with bytes flipped). Then properties of the framings themselves on
mutations hypothesis draws: each framing's sections are where a walk of its layout finds them."""
import gzip
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import framing_inputs
import kvcache
from kvcache import statefile
from kvcache._core import SEQ_MAGIC, describe_state, state_framings


@pytest.fixture(scope="module")
def recorded():
    with gzip.open(framing_inputs.ANSWERS, "rt") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def bases():
    return framing_inputs.bases(kvcache, np)


def test_answers_as_recorded(recorded):
    seen = 0
    diffs = []
    for key, blob, make, seq in framing_inputs.inputs(kvcache, np):
        got = framing_inputs.answer(kvcache, blob, make, seq)
        want = recorded.get(key)
        seen += 1
        if got != want:
            diffs.append((key, {k: (want.get(k) if want else None, v) for k, v in got.items()
                                if not want or want.get(k) != v}))
    assert not diffs, f"{len(diffs)} of {seen} differ; first: {diffs[:3]}"
    assert seen == len(recorded)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_framings_are_walks(bases, data):
    name, blob, _, _ = bases[data.draw(st.integers(0, len(bases) - 1), label="base")]
    b = bytearray(blob)
    for _ in range(data.draw(st.integers(0, 3))):
        if not b:
            break
        at = data.draw(st.integers(0, len(b) - 1))
        b[at] = data.draw(st.integers(0, 255))
    b = bytes(b[:data.draw(st.integers(0, len(b)))]) if data.draw(st.booleans()) else bytes(b)
    allow_prefix = data.draw(st.booleans())
    found, errors = state_framings(b, allow_prefix)
    for streams, prefixed, src, parts, ext, records in found:
        assert prefixed == (allow_prefix and b[:4] == SEQ_MAGIC.to_bytes(4, "little"))
        cache_parts = parts[:-1] if records else parts
        for secs in cache_parts:
            for off, n in secs:
                if n:
                    d = describe_state(b[off:], ext)
                    assert d["cell_count"] == n
        if records:
            ((off, n),) = parts[-1]
            d = describe_state(b[off:], 0, records)
            assert d["cell_count"] == n and off + d["size"] == len(b)
    plain = {(f[0], len(f[3])) for f in found if not f[4] and not f[5]}
    for streams in (True, False):
        for n_parts in (1, 2):
            assert ((streams, n_parts) in errors) != ((streams, n_parts) in plain)
    assert [statefile.Framing(s, p, i, parts, len(b), e, r) for s, p, i, parts, e, r in found] == \
        statefile.memory_framings(b, allow_prefix=allow_prefix)
