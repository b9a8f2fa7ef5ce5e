"""A slow, pure-Python model of the checkpoint pool of ``csrc/kvc_checkpoint.h`` (prefix reuse for
recurrent and hybrid memories).

:class:`CheckpointPoolModel` states the rules the C pool follows, written to be read:

- **A checkpoint** is the state after a chain of tokens under a salt; the pool holds at most one
  per (salt, chain).
- **Stamps.** One counter gives every use a new stamp: a save of a new chain (its stamp as made
  and as used), a save of a chain held (used), a match that hits (used), an attach that hits
  (used).
- **save** of a sequence's state after ``chain``: a chain held is only touched. Otherwise a slot
  is found: when the sequence made ``per_seq`` checkpoints still its own, its oldest unpinned one
  (made first) is replaced, or nothing is kept when all of them are pinned; else the new one
  takes free room, or replaces the least recently used unpinned one, or nothing is kept when all
  are pinned.
- **find** (``limit``): the deepest chain under the salt that begins the tokens, of at most
  ``limit`` tokens. A request of n tokens matches with ``limit = n - 1``; a hybrid memory's with
  the attention index's match as the limit.
- **Ownership.** A checkpoint is its sequence's own until that sequence is attached (a new
  request) or released.
- **pin / unpin** count; a pinned checkpoint is never replaced or evicted. **evict** drops the
  least recently used unpinned ones.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Checkpoint:
    salt: object
    chain: tuple[int, ...]
    made: int
    used: int
    owner: int
    pins: int = 0


class CheckpointPoolModel:
    def __init__(self, cap: int, per_seq: int = 0):
        self.cap = cap
        self.per_seq = per_seq
        self.held: list[Checkpoint] = []
        self.clock = 0

    def _stamp(self) -> int:
        self.clock += 1
        return self.clock

    def _exact(self, salt, chain) -> Checkpoint | None:
        return next((c for c in self.held if c.salt == salt and c.chain == tuple(chain)), None)

    def save(self, s: int, salt, chain) -> int:
        """The chain's length when kept, else 0."""
        chain = tuple(chain)
        same = self._exact(salt, chain)
        if same is not None:
            same.used = self._stamp()
            return len(chain)
        victim = None
        mine = [c for c in self.held if c.owner == s]
        if self.per_seq and len(mine) >= self.per_seq:
            free = [c for c in mine if not c.pins]
            if not free:
                return 0
            victim = min(free, key=lambda c: c.made)
        elif len(self.held) >= self.cap:
            free = [c for c in self.held if not c.pins]
            if not free:
                return 0
            victim = min(free, key=lambda c: c.used)
        if victim is not None:
            self.held.remove(victim)
        t = self._stamp()
        self.held.append(Checkpoint(salt, chain, t, t, s))
        return len(chain)

    def find(self, salt, tokens, limit: int) -> Checkpoint | None:
        tokens = tuple(tokens)
        best = None
        for c in self.held:
            if c.salt == salt and len(c.chain) <= limit and tokens[:len(c.chain)] == c.chain:
                if best is None or len(c.chain) > len(best.chain):
                    best = c
        return best

    def match(self, salt, tokens, limit: int | None = None) -> int:
        limit = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        c = self.find(salt, tokens, limit) if limit > 0 else None
        if c is None:
            return 0
        c.used = self._stamp()
        return len(c.chain)

    def disown(self, s: int) -> None:
        for c in self.held:
            if c.owner == s:
                c.owner = -1

    def pin(self, salt, chain) -> Checkpoint | None:
        c = self._exact(salt, chain)
        if c is not None:
            c.pins += 1
        return c

    def unpin(self, c: Checkpoint) -> bool:
        if c not in self.held or not c.pins:
            return False
        c.pins -= 1
        return True

    def evict(self, n: int) -> int:
        done = 0
        while done < n:
            free = [c for c in self.held if not c.pins]
            if not free:
                break
            self.held.remove(min(free, key=lambda c: c.used))
            done += 1
        return done

    def chains(self) -> list[tuple[tuple[int, ...], int]]:
        """(chain, pins) of every checkpoint, shortest first (ties by chain)."""
        return sorted(((c.chain, c.pins) for c in self.held), key=lambda x: (len(x[0]), x[0]))
