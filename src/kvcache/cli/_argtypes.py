"""Argument types shared by the CLI commands (kvcache/cli/*.py): argparse turns their ArgumentTypeError into a
usage error naming the option."""
from __future__ import annotations

import argparse
import math
from typing import Callable


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= minimum."""
    def parse(text: str) -> int:
        v = _whole(text)
        if v < minimum:
            bound = ">= 0" if minimum == 0 else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
        return v
    parse.__name__ = "count" if minimum == 1 else f"int_at_least_{minimum}"
    return parse


count = int_at_least(1)
nonneg_int = int_at_least(0)


def number(text: str) -> float:
    """A finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return v
