"""Argument types shared by the CLI commands (kvcache/cli/*.py): one factory per kind of number,
each checking its range (kept as the type's ``bounds``). argparse turns their ArgumentTypeError
into a one-line usage error that names the option ("argument --seq-id: must be at most 255, got
300")."""
from __future__ import annotations

import argparse
import math
import re
from fractions import Fraction
from typing import Callable, Union

#: the largest of llama.cpp's sizes and counts (int32)
INT32_MAX = 2**31 - 1
#: numpy's generators take seeds of any size; 64 bits is what a seed carries
SEED_MAX = 2**64 - 1


def _check(v: float, text: str, lo: float | None, hi: float | None) -> None:
    """Refuse v (read from text) outside [lo, hi] (None: no bound on that side)."""
    if (lo is None or v >= lo) and (hi is None or v <= hi):
        return
    if lo is not None and hi is not None and isinstance(v, float):
        raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}], got {text}")
    if lo is not None and v < lo:
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if lo == 0 else f'at least {lo:g}'}, got {text}")
    raise argparse.ArgumentTypeError(f"must be at most {hi}, got {text}")


def whole(lo: int, hi: int = INT32_MAX) -> Callable[[str], int]:
    """A whole number in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        _check(v, str(v), lo, hi)
        return v
    parse.__name__ = "whole number"   # argparse's "invalid <name> value" for anything else
    parse.bounds = (lo, hi)  # type: ignore[attr-defined]
    return parse


def wholes(lo: int, hi: int = INT32_MAX) -> Callable[[str], Union[int, list[int]]]:
    """A whole number in [lo, hi], or a comma list of them (one per layer): an int for one."""
    def parse(text: str) -> Union[int, list[int]]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int or a comma list of ints, got {text!r}") from None
        for v in vals:
            _check(v, str(v), lo, hi)
        return vals[0] if len(vals) == 1 else vals
    parse.__name__ = "list of whole numbers"
    parse.bounds = (lo, hi)  # type: ignore[attr-defined]
    return parse


def real(lo: float | None = None, hi: float | None = None) -> Callable[[str], float]:
    """A finite number in [lo, hi] (None: no bound on that side)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        _check(v, text, lo, hi)
        return v
    parse.__name__ = "number"
    parse.bounds = (lo, hi)  # type: ignore[attr-defined]
    return parse


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(lo: int = 0, hi: int = 2**63 - 1) -> Callable[[str], int]:
    """A byte count in [lo, hi]: a number with an optional K, M, G or T suffix (powers of 1024;
    "2G", "500M", "1.5GiB")."""
    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
        if not m:
            raise argparse.ArgumentTypeError(f"expected a size in bytes such as 500M or 2G, got {text!r}")
        v = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])   # exact, however large
        _check(v, text, lo, hi)
        return v
    parse.__name__ = "size"
    parse.bounds = (lo, hi)  # type: ignore[attr-defined]
    return parse


count = whole(1)
nonneg_int = whole(0)
seed = whole(0, SEED_MAX)
number = real()
