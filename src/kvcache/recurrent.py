"""The recurrent-state cache of Mamba / RWKV style models (see :class:`RecurrentCache`)."""
from kvcache._core import RecurrentCache

__all__ = ["RecurrentCache"]
