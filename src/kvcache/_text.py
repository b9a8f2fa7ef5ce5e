"""Wording shared by the text reports (kvcache.inspect, plan, simulate, demo)."""
from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word`` agreeing with it: "1 cell", "2 cells", "1 ubatch", "3 ubatches"."""
    if n == 1:
        return f"{n} {word}"
    if many is None:
        many = word + ("es" if word.endswith(("ch", "sh", "s", "x")) else "s")
    return f"{n} {many}"
