"""A pure-Python model of today's hybrid memory (llama.cpp's ``llama_memory_hybrid``) and of its
recurrent part (``llama_memory_recurrent`` with rollback snapshots), written from llama.cpp's
source rule by rule, with kvcache's rule C9 (docs/semantics.md) where llama.cpp is wrong.

The attention part is the model of today's unified cache (reference2026.UnifiedReference2026);
the recurrent part is :class:`RecurrentReference2026` below. :class:`HybridReference` drives both
as llama.cpp does: the recurrent part is prepared and asked first, a ubatch is placed in both or
in neither, a ``seq_rm`` the recurrent part refuses changes neither, a sequence's position range
is the intersection of the parts'."""
from __future__ import annotations

from typing import Any, Sequence

from reference2026 import UnifiedReference2026

POS_END = 2**31          # past every position: the upper bound of an open range


def _range(p0: int, p1: int) -> tuple[int, int]:
    return max(p0, 0), (POS_END if p1 < 0 else p1)


class RecurrentReference2026:
    """Today's recurrent memory: ``size`` cells, each with a position, a source (``src``), the
    staged source (``src0``) and a set of sequences; cell i is also sequence i's record
    (``tail``: the cell holding its state). ``rs_idx[s]``: the snapshot plane a pending rollback
    of s reads; ``snap[i]``: the planes cell i's last ubatch wrote (kvcache's record, rule C9)."""

    def __init__(self, size: int, n_seq_max: int, n_rs_seq: int = 0):
        self.size = size
        self.n_seq_max = n_seq_max
        self.n_rs_seq = n_rs_seq
        self.pos = [-1] * size
        self.src = [-1] * size
        self.src0 = [-1] * size
        self.tail = [-1] * size
        self.seqs: list[set[int]] = [set() for _ in range(size)]
        self.rs_idx = [0] * size
        self.snap = [0] * size
        self.head = 0
        self.n = 0
        self.used = 0
        self.rs_z = -1

    def copy(self) -> "RecurrentReference2026":
        c = RecurrentReference2026(self.size, self.n_seq_max, self.n_rs_seq)
        for k, v in vars(self).items():
            setattr(c, k, [set(x) for x in v] if k == "seqs" else (list(v) if isinstance(v, list) else v))
        return c

    def _drop(self, i: int) -> None:
        self.pos[i] = -1
        self.src[i] = -1

    def _forget(self, s: int) -> None:
        # C9: a pending rollback goes with its state
        self.rs_idx[s] = 0

    def clear(self) -> None:
        for i in range(self.size):
            self.pos[i] = self.src[i] = self.tail[i] = -1
            self.seqs[i] = set()
        self.rs_idx = [0] * self.size
        self.snap = [0] * self.size
        self.head = self.used = 0

    def rollback_ok(self, s: int, r: int) -> bool:
        t = self.tail[s]
        if t < 0 or self.rs_idx[s] != 0 or not 1 <= r <= self.n_rs_seq:
            return False
        return r <= self.snap[t] and len(self.seqs[t]) == 1        # C9

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> bool:
        p0, p1 = _range(p0, p1)
        if p0 == 0 and p1 == POS_END:
            if s < 0:
                self.rs_idx = [0] * self.size
            else:
                self._forget(s)
        if s >= 0:
            t = self.tail[s]
            if t >= 0:
                cpos = self.pos[t]
                if 0 < p0 <= cpos < p1:
                    back = cpos - p0 + 1
                    if not self.rollback_ok(s, back):
                        return False
                    self.rs_idx[s] = back
                    self.pos[t] = p0 - 1
                    return True
                if 0 < p0 <= cpos or 0 < p1 <= cpos:       # C9: no cut inside a state
                    return False
                if p0 <= cpos < p1:
                    self.tail[s] = -1
                    self._forget(s)
        elif p0 != p1 and (p0 != 0 or p1 != POS_END):
            return False
        new_head = self.size
        for i in range(self.size):
            if not p0 <= self.pos[i] < p1:
                continue
            if s < 0:
                self.seqs[i] = set()
            elif s in self.seqs[i]:
                self.seqs[i].discard(s)
            else:
                continue
            if not self.seqs[i]:
                if self.pos[i] >= 0:
                    self.used -= 1
                self._drop(i)
                if new_head == self.size:
                    new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, a: int, b: int) -> None:
        if a == b:
            return
        if self.tail[b] >= 0:
            cd = self.tail[b]
            self.seqs[cd].discard(b)
            self.tail[b] = -1
            if not self.seqs[cd]:
                self._drop(cd)
                self.used -= 1
        self.rs_idx[b] = 0
        if self.tail[a] >= 0:
            cs = self.tail[a]
            self.seqs[cs].add(b)
            self.tail[b] = cs
            self.rs_idx[b] = self.rs_idx[a]            # C9: the copy shares the pending plane

    def seq_keep(self, s: int) -> None:
        new_head = self.size
        for i in range(self.size):
            if i != s:
                self.tail[i] = -1
                self.rs_idx[i] = 0
            if s not in self.seqs[i]:
                if self.pos[i] >= 0:
                    self.used -= 1
                self._drop(i)
                self.seqs[i] = set()
                if new_head == self.size:
                    new_head = i
            else:
                self.seqs[i] = {s}
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    def _tail_in(self, s: int, p0: int, p1: int) -> int:
        p0, p1 = _range(p0, p1)
        if p0 == p1:
            return -1
        t = self.tail[s]
        if t < 0 or s not in self.seqs[t] or not p0 <= self.pos[t] < p1:
            return -1
        return t

    def seq_add(self, s: int, p0: int, p1: int, shift: int) -> None:
        t = self._tail_in(s, p0, p1) if shift else -1
        if t >= 0:
            self.pos[t] = min(self.pos[t] + shift, 2**31 - 1)   # saturates, as an attention cell's

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        t = self._tail_in(s, p0, p1) if d != 1 else -1
        if t >= 0:
            self.pos[t] = int(self.pos[t] / d)

    def seq_pos_min(self, s: int) -> int:
        ps = [self.pos[i] for i in range(self.size) if s in self.seqs[i]]
        return min(ps) if ps else -1

    def seq_pos_max(self, s: int) -> int:
        # llama.cpp starts from -1: a state shifted below it answers -1
        return max([-1] + [self.pos[i] for i in range(self.size) if s in self.seqs[i]])

    def _next_empty(self, start: int) -> int:
        i = start
        for _ in range(self.size):
            if i >= self.size:
                i -= self.size
            if not self.seqs[i]:
                break
            i += 1
        return i

    def find_slot(self, pos: Sequence[int], groups: Sequence[Sequence[int]], k: int) -> bool | None:
        """Place groups of k tokens (group g: ids groups[g], positions pos[g*k:(g+1)*k]): True
        placed, False the sanity check failed, None no room (then nothing changed)."""
        work = self.copy()
        r = work._find_slot(pos, groups, k)
        if r is not None:
            vars(self).update(vars(work))
        return r

    def _find_slot(self, pos: Sequence[int], groups: Sequence[Sequence[int]], k: int) -> bool | None:
        n_seqs = len(groups)
        if self.head > self.used + 2 * n_seqs:
            self.head = 0
        lo, hi = self.size - 1, 0
        for g in groups:
            for s in g[1:]:
                t = self.tail[s]
                if t >= 0:
                    self.seqs[t].discard(s)
                    self.tail[s] = -1
                    self._forget(s)
                    if not self.seqs[t]:
                        self._drop(t)
                        self.used -= 1
        nxt = self._next_empty(self.head)
        for gi, g in enumerate(groups):
            s = g[0]
            t = self.tail[s]
            if t >= 0 and s not in self.seqs[t]:
                return None        # a record left by seq_rm(-1, ...): llama.cpp aborts, kvcache raises
            has_cell = t >= 0 and len(self.seqs[t]) == 1
            if not has_cell:
                if nxt >= self.size or self.seqs[nxt]:
                    return None
                if t >= 0:
                    self.pos[nxt] = self.pos[t]
                    self.src[nxt] = self.src[t]
                    self.seqs[t].discard(s)
                    self.seqs[nxt].add(s)
                self.tail[s] = nxt
                if gi + 1 < n_seqs:
                    nxt = self._next_empty(nxt + 1)
            lo = min(lo, self.tail[s])
            hi = max(hi, self.tail[s])
        for gi, g in enumerate(groups):
            d, r = gi + lo, self.tail[g[0]]
            if d >= self.size:
                return None
            if d != r:
                self.pos[d], self.pos[r] = self.pos[r], self.pos[d]
                self.src[d], self.src[r] = self.src[r], self.src[d]
                self.seqs[d], self.seqs[r] = self.seqs[r], self.seqs[d]
                for q in self.seqs[r]:
                    self.tail[q] = r
                for q in self.seqs[d]:
                    self.tail[q] = d
        for gi, g in enumerate(groups):
            cell = gi + lo
            self.pos[cell] = pos[gi * k + k - 1]
            self.seqs[cell] = set(g)
            for s in g:
                self.tail[s] = cell
        refs = {self.src[j] for j in range(self.size)}
        self.rs_z = next((i for i in range(lo, hi + 1) if i not in refs), -1)
        for i in range(lo, hi + 1):
            if self.src[i] < 0:
                if self.rs_z < 0:
                    return None
                self.src0[i] = self.rs_z
            else:
                self.src0[i] = self.src[i]
            self.src[i] = i
        for gi in range(n_seqs):
            self.snap[lo + gi] = min(k - 1, self.n_rs_seq)
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for x in self.seqs if x)
        return self.n >= n_seqs

    def s_copy(self) -> list[int]:
        out = []
        for i in range(self.n):
            cell = self.head + i
            plane = 0
            if self.n_rs_seq and self.seqs[cell]:
                first = min(self.seqs[cell])
                plane, self.rs_idx[first] = self.rs_idx[first], 0
            out.append(plane * self.size + self.src0[cell])
        return out

    def table(self) -> dict[str, Any]:
        return {"pos": list(self.pos), "src": list(self.src), "tail": list(self.tail),
                "seq_id": [sorted(x) for x in self.seqs], "head": self.head, "n": self.n, "used": self.used,
                "rs_z": self.rs_z, "pending": list(self.rs_idx[:self.n_seq_max])}


class HybridReference:
    """Today's hybrid memory over the two models."""

    def __init__(self, kv_size: int, n_layer: int, recurrent_layers: Sequence[int], n_seq_max: int = 1,
                 n_rs_seq: int = 0, kv_unified: bool = True, n_embd: int = 4):
        attn = [il for il in range(n_layer) if il not in set(recurrent_layers)]
        self.attn = UnifiedReference2026(kv_size, n_layer, n_embd, n_embd, type_k="f32", type_v="f32",
                                         n_seq_max=n_seq_max, n_pad=1, kv_unified=kv_unified, layers=attn)
        self.recr = RecurrentReference2026(max(1, n_seq_max), n_seq_max, n_rs_seq)

    def find_slot(self, ub: Any, groups: Sequence[Sequence[int]], k: int) -> bool | None:
        """True placed in both, False in neither, None: the recurrent part cannot take it at all
        (kvcache raises; nothing changed)."""
        saved = self.recr.copy()
        r = self.recr.find_slot(list(ub.pos), groups, k)
        if r is None:
            return None
        if not r:
            self.recr = saved
            return False
        if not self.attn.find_slot(ub):
            self.recr = saved
            return False
        return True

    def prepare(self, ubs: Sequence[tuple[Any, Sequence[Sequence[int]], int]]) -> Any:
        work = self.recr.copy()
        for ub, groups, k in ubs:
            if not work.find_slot(list(ub.pos), groups, k):
                return None
        return self.attn.prepare([u for u, _, _ in ubs])

    def clear(self) -> None:
        self.attn.clear()
        self.recr.clear()

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> bool:
        if not self.recr.seq_rm(s, p0, p1):
            return False
        return self.attn.seq_rm(s, p0, p1)

    def seq_cp(self, a: int, b: int, p0: int = -1, p1: int = -1) -> None:
        self.attn.seq_cp(a, b, p0, p1)
        self.recr.seq_cp(a, b)

    def seq_keep(self, s: int) -> None:
        self.attn.seq_keep(s)
        self.recr.seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, shift: int) -> None:
        self.attn.seq_add(s, p0, p1, shift)
        self.recr.seq_add(s, p0, p1, shift)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self.attn.seq_div(s, p0, p1, d)
        self.recr.seq_div(s, p0, p1, d)

    def seq_pos_min(self, s: int) -> int:
        return max(self.attn.seq_pos_min(s), self.recr.seq_pos_min(s))

    def seq_pos_max(self, s: int) -> int:
        return min(self.attn.seq_pos_max(s), self.recr.seq_pos_max(s))
