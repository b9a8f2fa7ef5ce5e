"""A slow, pure-Python model of the prefix index of ``csrc/kvc_prefix.h``.

:class:`PrefixIndexModel` is an executable description of the index, written to be read, not to
be fast: a tree of :class:`Node` (one per edge, a run of tokens and the cells holding them), a
root per salt, and everything else — protection, the counters, which node goes next — computed
from the tree when asked, by walking it. ``tests/test_prefix_index_model.py`` runs random
operations on it and on the C index (through ``tests/c/prefix_driver``) and compares every result.

The rules it states:

- **The tree.** Under each salt a root; below it edges of at least one token; no two children of
  a node start with the same token; a prompt is held when its tokens are the labels of a path
  from its salt's root. Each cell ``(cell, stream)`` holds one token of one edge.
- **insert** walks the prompt down the tree. The tokens found (``present``) keep the index's
  cells; a caller's cell that differs from the index's is a duplicate, returned for the caller
  to free. The cells the index takes, and the duplicates, must not be held by it and not repeat
  (else ``"arg"``, nothing changed). The rest of the prompt becomes a new leaf; where the walk
  stopped inside an edge, the edge is split there first (the new upper node takes the edge's
  place among its parent's children; the old node keeps the lower part). With a cap, the cells
  beyond it are evicted first, never from the prompt's own path (``"nospace"`` when the
  evictable cells off that path are too few, nothing changed).
- **match** returns the longest present prefix of at most ``max_len`` tokens, its cells and the
  node holding its last token.
- **Protection.** A node is protected while it or a node below it holds a lock or a pin.
- **Recency.** Each node has a tick, a number taken from one counter. A match or an insert
  gives new ticks to the nodes of its path, the deepest first; so does a node's becoming
  unprotected (a last unlock or unpin, a removal of the locked nodes below it), to the nodes of
  the path that became unprotected, the deepest first.
- **evict** takes, one at a time, the unprotected leaf with the smallest tick, until the cells
  asked for are gone or no unprotected leaf is left; a root left without children goes too.
- **remove** of cells the cache let go: from each named cell held, in order, the rest of its
  edge and every node below are dropped; the cells dropped that were not named are returned,
  each edge's tokens in order, an edge before its children, children in their order.
- **clear** forgets everything; every handle goes stale (as one whose node was dropped).
"""
from __future__ import annotations

from dataclasses import dataclass, field

Cell = tuple[int, int]   # (cell, stream)


@dataclass(eq=False)
class Node:
    tokens: list[int]
    cells: list[Cell]
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)   # first token -> child, in order
    salt: int | None = None   # roots only
    locks: int = 0
    pins: int = 0
    tick: int = 0
    alive: bool = True

    def path(self) -> list["Node"]:
        """This node and the nodes above it, the deepest first, roots left out."""
        out, n = [], self
        while n is not None and n.salt is None:
            out.append(n)
            n = n.parent
        return out

    def subtree(self) -> list["Node"]:
        """This node and every node below it, an edge before its children."""
        out = [self]
        for c in self.children.values():
            out += c.subtree()
        return out


@dataclass
class Inserted:
    present: int
    dup: list[Cell]
    evicted: list[Cell]
    end: Node | None


class PrefixIndexModel:
    def __init__(self, n_stream: int, n_cells: int, cap: int = 0):
        assert n_stream >= 1 and n_cells >= 1
        self.n_stream, self.n_cells, self.cap = n_stream, n_cells, cap
        self.roots: dict[int, Node] = {}
        self.clock = 0

    # --- what the tree says ----------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        return [n for r in self.roots.values() for c in r.children.values() for n in c.subtree()]

    def protected(self, n: Node) -> bool:
        return any(d.locks + d.pins > 0 for d in n.subtree())

    def held(self) -> dict[Cell, tuple[Node, int]]:
        return {c: (n, k) for n in self.nodes() for k, c in enumerate(n.cells)}

    def n_held(self) -> int:
        return sum(len(n.cells) for n in self.nodes())

    def n_evictable(self) -> int:
        return sum(len(n.cells) for n in self.nodes() if not self.protected(n))

    def n_nodes(self) -> int:
        return len(self.nodes())

    def in_range(self, c: Cell) -> bool:
        return 0 <= c[0] < self.n_cells and 0 <= c[1] < self.n_stream

    # --- the operations ----------------------------------------------------------------------------
    def lookup(self, salt: int, tokens: list[int]) -> tuple[int, list[Cell], Node | None, int]:
        """The walk of a prompt, touching nothing: (tokens matched, their cells, the node holding
        the last, how many of its tokens matched)."""
        m, cells, deepest, off = 0, [], None, 0
        at = self.roots.get(salt)
        while at is not None and m < len(tokens) and tokens[m] in at.children:
            e = at.children[tokens[m]]
            k = 0
            while k < len(e.tokens) and m + k < len(tokens) and e.tokens[k] == tokens[m + k]:
                k += 1
            cells += e.cells[:k]
            m, deepest, off = m + k, e, k
            if k < len(e.tokens):
                break
            at = e
        return m, cells, deepest, off

    def touch(self, nodes: list[Node]) -> None:
        for n in nodes:
            self.clock += 1
            n.tick = self.clock

    def match(self, salt: int, tokens: list[int], max_len: int) -> tuple[int, list[Cell], Node | None]:
        m, cells, deepest, _ = self.lookup(salt, tokens[:max_len])
        if deepest is not None:
            self.touch(deepest.path())
        return m, cells, deepest

    def insert(self, salt: int, tokens: list[int], cells: list[Cell]) -> Inserted | str:
        n = len(tokens)
        if n == 0:
            return Inserted(0, [], [], None)
        if not all(self.in_range(c) for c in cells):
            return "arg"
        m, own, deepest, off = self.lookup(salt, tokens)
        held, seen, dup = self.held(), set(), []
        for i, c in enumerate(cells):
            if i < m and c == own[i]:
                continue
            if c in held or c in seen:
                return "arg"
            seen.add(c)
            if i < m:
                dup.append(c)
        if m == n:
            if deepest is not None:
                self.touch(deepest.path())
            return Inserted(m, dup, [], deepest)
        evicted = []
        need = self.n_held() + (n - m) - self.cap if self.cap else 0
        if need > 0:
            path = deepest.path() if deepest is not None else []
            spared = sum(len(p.cells) for p in path if not self.protected(p))
            if self.n_evictable() - spared < need:
                return "nospace"
            evicted = self.evict(need, spare=path)
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node([], [], salt=salt)
        parent = root if deepest is None else deepest
        if deepest is not None and off < len(deepest.tokens):
            parent = self.split(deepest, off)
        leaf = Node(tokens[m:], cells[m:], parent=parent)
        parent.children[tokens[m]] = leaf
        self.touch(leaf.path())
        return Inserted(m, dup, evicted, leaf)

    def split(self, n: Node, k: int) -> Node:
        """n's first k tokens become a new node in n's place; n keeps the rest, below it."""
        p = n.parent
        up = Node(n.tokens[:k], n.cells[:k], parent=p, tick=n.tick)
        p.children = {t: (up if c is n else c) for t, c in p.children.items()}
        n.tokens, n.cells, n.parent = n.tokens[k:], n.cells[k:], up
        up.children = {n.tokens[0]: n}
        return up

    def _protect(self, h: Node | None, attr: str, by: int) -> str:
        if h is None:
            return "ok"
        if not h.alive or (by < 0 and getattr(h, attr) == 0):
            return "arg"
        before = [self.protected(p) for p in h.path()]
        setattr(h, attr, getattr(h, attr) + by)
        self.touch_unprotected(h.path(), before)
        return "ok"

    def touch_unprotected(self, path: list[Node], before: list[bool]) -> None:
        """New ticks for the nodes of path (deepest first) that were protected and are not."""
        self.touch([p for p, was in zip(path, before) if was and not self.protected(p)])

    def lock(self, h): return self._protect(h, "locks", 1)
    def unlock(self, h): return self._protect(h, "locks", -1)
    def pin(self, h): return self._protect(h, "pins", 1)
    def unpin(self, h): return self._protect(h, "pins", -1)

    def drop(self, n: Node) -> None:
        """Take node n and everything below it out of the tree."""
        for d in n.subtree():
            d.alive = False
        p = n.parent
        del p.children[n.tokens[0]]
        if p.salt is not None and not p.children:
            del self.roots[p.salt]

    def evict(self, want: int, spare: list[Node] = ()) -> list[Cell]:
        freed: list[Cell] = []
        while len(freed) < want:
            leaves = [n for n in self.nodes() if not n.children and not self.protected(n)
                      and not any(n is s for s in spare)]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.tick)
            freed += victim.cells
            self.drop(victim)
        return freed

    def remove(self, cells: list[Cell]) -> list[Cell]:
        held = self.held()
        named = {c for c in cells if c in held}
        freed: list[Cell] = []
        for c in cells:
            where = self.held().get(c)
            if where is None:
                continue
            n, k = where
            survivor = n if k > 0 else n.parent
            path = survivor.path() if survivor.salt is None else []
            before = [self.protected(p) for p in path]
            dropped = n.cells[k:] + [x for d in list(n.children.values()) for s in d.subtree() for x in s.cells]
            freed += [x for x in dropped if x not in named]
            if k == 0:
                self.drop(n)
            else:
                for d in list(n.children.values()):
                    self.drop(d)
                n.tokens, n.cells = n.tokens[:k], n.cells[:k]
            self.touch_unprotected(path, before)
        return freed

    def clear(self) -> None:
        for n in self.nodes():
            n.alive = False
        self.roots = {}
