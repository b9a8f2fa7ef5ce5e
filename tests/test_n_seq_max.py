"""n_seq_max: every cache type takes 1 to 256 sequences and refuses anything else with the same
message, from the one check their constructors share."""
import pytest

from kvcache import ISWACache, RecurrentCache, UnifiedCache

MAKERS = {
    "unified": lambda n: UnifiedCache(32, 1, 4, 4, n_seq_max=n),
    "iswa": lambda n: ISWACache(128, 2, 4, 4, swa_layers=[0], n_swa=4, n_batch=8, n_seq_max=n),
    "recurrent": lambda n: RecurrentCache(n, 1, 4, 4, kv_size=max(n, 1)),
}


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("n", [0, 257])
def test_every_cache_refuses_the_same_n_seq_max(kind, n):
    with pytest.raises(ValueError) as e:
        MAKERS[kind](n)
    assert str(e.value).endswith(f"n_seq_max ({n}) must be in [1, 256]")


@pytest.mark.parametrize("kind", MAKERS)
@pytest.mark.parametrize("n", [1, 256])
def test_every_cache_takes_1_to_256_sequences(kind, n):
    assert MAKERS[kind](n).n_seq_max == n


def test_a_recurrent_cache_of_one_sequence_has_one_cell_by_default():
    assert RecurrentCache(1, 1, 4, 4).size == 1
