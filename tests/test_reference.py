"""The pure-Python reference model of the seed's cache (tests/reference.py) on what the unified
golden traces exercise little: T5 position buckets. The traces themselves replay against the
model through the trace-op table (its target ``conformance.unified.reference_target``)
in tests/test_golden.py, and tests/test_stateful.py drives it beside the C-backed cache."""
import pytest

from reference import relative_position_bucket


@pytest.mark.parametrize("p0,p1,n_buckets,expected", [
    (5, 5, 32, 0), (3, 5, 32, 2), (9, 5, 32, 0), (-1, 0, 32, 1),
    (0, 15, 32, 15), (0, 16, 32, 16), (0, 1000, 32, 31), (0, 127, 32, 31),
])
def test_relative_position_bucket(p0, p1, n_buckets, expected):
    assert relative_position_bucket(p0, p1, n_buckets) == expected
