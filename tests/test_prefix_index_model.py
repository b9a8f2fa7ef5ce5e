"""The C prefix index (csrc/kvc_prefix.h) against its Python model (tests/reference_prefix.py):
random operations — inserts of prompts that share prefixes (splits, duplicates, bad cells),
matches, locks and pins, evictions, caps, removals, clears — run on both, and every result line
is compared: statuses, cells in order, eviction order, the counters. The C side runs in
tests/c/prefix_driver (built here with `make -C tests/c`, under ASan and UBSan; it checks the
index's invariants after every operation), which reads the operations as text.
"""
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from reference_prefix import Inserted, PrefixIndexModel

try:
    from hypothesis import given, strategies as st
except ImportError:  # the test extra; without it the property test skips
    given = None

CTESTS = REPO / "tests" / "c"


def _cells(cells) -> str:
    return "[" + " ".join(f"{c}:{s}" for c, s in cells) + "]"


class Replay:
    """Runs the driver's text operations on the model and writes the lines the driver writes."""

    def __init__(self):
        self.model: PrefixIndexModel | None = None
        self.handles: list = []

    def run(self, line: str) -> str:
        op, *a = line.split()
        v = [int(x) for x in a]
        m = self.model
        if op == "init":
            self.model, self.handles = PrefixIndexModel(v[0], v[1], v[2]), []
            m, out = self.model, "ok"
        elif op == "insert":
            salt, n, rest = v[0], v[1], v[2:]
            toks = rest[0::3][:n]
            cells = list(zip(rest[1::3][:n], rest[2::3][:n]))
            r = m.insert(salt, toks, cells)
            if isinstance(r, Inserted):
                self.handles.append(r.end)
                out = (f"ok present={r.present} dup={_cells(r.dup)} evicted={_cells(r.evicted)} "
                       f"h={len(self.handles) - 1}")
            else:
                out = r
        elif op == "match":
            salt, max_len, n, toks = v[0], v[1], v[2], v[3:]
            k, cells, end = m.match(salt, toks[:n], max_len)
            self.handles.append(end)
            out = f"{k} cells={_cells(cells)} h={len(self.handles) - 1}"
        elif op in ("lock", "unlock", "pin", "unpin"):
            out = getattr(m, op)(self.handles[v[0]])
        elif op == "evict":
            out = f"evicted freed={_cells(m.evict(v[0]))}"
        elif op == "remove":
            out = f"removed freed={_cells(m.remove(list(zip(v[1::2], v[2::2]))))}"
        elif op == "cap":
            m.cap, out = v[0], "ok"
        elif op == "clear":
            m.clear()
            out = "ok"
        else:
            raise ValueError(op)
        return f"{out} | held={m.n_held()} evictable={m.n_evictable()} nodes={m.n_nodes()}"


class Generator:
    """Operations worth running, drawn against the model's state: prompts over a few tokens that
    extend earlier prompts (long shared prefixes, splits), mostly free cells, sometimes the
    index's own cells or bad ones."""

    def __init__(self, replay: Replay, n_stream=2, n_cells=24, cap=0):
        self.replay, self.n_stream, self.n_cells = replay, n_stream, n_cells
        self.prompts: list[tuple[int, list[int]]] = []
        self.lines = [f"init {n_stream} {n_cells} {cap}"]
        self.outputs = [replay.run(self.lines[0])]

    def prompt(self, rng: random.Random) -> tuple[int, list[int]]:
        salt = rng.choice((0, 0, 0, 7, 2**63 + 5))
        base: list[int] = []
        if self.prompts and rng.random() < 0.8:
            salt, old = rng.choice(self.prompts)
            base = old[:rng.choice((len(old), rng.randint(0, len(old))))]
        return salt, base + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]

    def free_cell(self, rng: random.Random, taken: set) -> tuple[int, int]:
        held = self.replay.model.held()
        free = [(c, s) for s in range(self.n_stream) for c in range(self.n_cells)
                if (c, s) not in held and (c, s) not in taken]
        return rng.choice(free) if free else (0, 0)

    def op(self, kind: int, seed: int) -> None:
        rng = random.Random(seed)
        m = self.replay.model
        n_handles = len(self.replay.handles)
        if kind <= 3:
            salt, toks = self.prompt(rng)
            _, own, _, _ = m.lookup(salt, toks)
            taken, cells = set(), []
            for i in range(len(toks)):
                if i < len(own) and rng.random() < 0.7:
                    cells.append(own[i])
                else:
                    cells.append(self.free_cell(rng, taken))
                taken.add(cells[-1])
            if cells and rng.random() < 0.05:   # a bad cell: out of range, held or repeated
                j = rng.randrange(len(cells))
                cells[j] = rng.choice([(self.n_cells, 0), (0, self.n_stream), cells[0], *m.held()])
            self.prompts.append((salt, toks))
            line = f"insert {salt} {len(toks)} " + " ".join(f"{t} {c} {s}" for t, (c, s) in zip(toks, cells))
        elif kind <= 6:
            salt, toks = self.prompt(rng)
            max_len = rng.choice((len(toks), max(len(toks) - 1, 0), rng.randint(0, 8)))
            line = f"match {salt} {max_len} {len(toks)} " + " ".join(map(str, toks))
        elif kind == 7 and n_handles:
            h = rng.randrange(max(0, n_handles - 4), n_handles) if rng.random() < 0.8 else rng.randrange(n_handles)
            line = f"{rng.choice(('lock', 'lock', 'unlock', 'unlock', 'pin', 'unpin'))} {h}"
        elif kind == 8:
            line = f"evict {rng.randint(0, 8)}"
        elif kind == 9:
            held = list(m.held())
            named = rng.sample(held, min(len(held), rng.randint(0, 3))) + [self.free_cell(rng, set())]
            rng.shuffle(named)
            line = f"remove {len(named)} " + " ".join(f"{c} {s}" for c, s in named)
        else:
            line = rng.choice((f"cap {rng.choice((0, 6, 12, 20))}", "clear" if rng.random() < 0.2 else "evict 1"))
        self.lines.append(line)
        self.outputs.append(self.replay.run(line))


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The driver, built in a folder of this test's own (parallel test processes each build theirs),
    running until the module is done."""
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no make or C compiler: the prefix index's driver (tests/c/prefix_driver) cannot be built")
    build = tmp_path_factory.mktemp("prefix_build")
    r = subprocess.run(["make", "-s", "-C", str(CTESTS), f"BUILD={build}", f"{build}/prefix_driver"],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"building tests/c/prefix_driver failed:\n{r.stdout}\n{r.stderr}"
    p = subprocess.Popen([str(build / "prefix_driver")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, bufsize=1)
    yield p
    p.stdin.close()
    p.wait(timeout=30)


def run_driver(p: subprocess.Popen, lines: list[str]) -> list[str]:
    p.stdin.write("\n".join(lines) + "\nend\n")
    p.stdin.flush()
    out = []
    while (line := p.stdout.readline()) != "end\n":
        if not line:
            pytest.fail(f"tests/c/prefix_driver stopped (exit {p.wait()}):\n{p.stderr.read()}")
        out.append(line.rstrip("\n"))
    return out


def compare(driver, gen: Generator) -> None:
    got = run_driver(driver, gen.lines)
    for i, (line, want) in enumerate(zip(gen.lines, gen.outputs)):
        assert i < len(got) and got[i] == want, (
            f"operation {i}: {line}\n  C:     {got[i] if i < len(got) else '(nothing)'}\n  model: {want}\n"
            "operations:\n" + "\n".join(gen.lines[:i + 1]))
    assert len(got) == len(gen.outputs), f"the driver wrote more: {got[len(gen.outputs):]}"


if given is not None:
    @given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 2**32 - 1)), max_size=60),
           st.sampled_from((0, 0, 8, 16)))
    def test_random_operations(driver, ops, cap):
        gen = Generator(Replay(), cap=cap)
        for kind, seed in ops:
            gen.op(kind, seed)
        compare(driver, gen)
else:
    def test_random_operations():
        pytest.skip("hypothesis is not installed")


@pytest.mark.parametrize("seed", range(4))
def test_long_runs(driver, seed):
    """Longer runs than the property test's: 400 operations from fixed seeds, with and without a
    cap, a few streams."""
    rng = random.Random(seed)
    gen = Generator(Replay(), n_stream=1 + seed % 3, n_cells=32, cap=(0, 20, 0, 40)[seed])
    for _ in range(400):
        gen.op(rng.randint(0, 10), rng.getrandbits(32))
    compare(driver, gen)


def test_model_eviction_order():
    """The model's own rules on a small case: leaves before parents, least recently used first,
    locks and pins protect the path."""
    m = PrefixIndexModel(1, 16)
    m.insert(0, [1, 2, 3], [(0, 0), (1, 0), (2, 0)])
    m.insert(0, [1, 2, 4], [(0, 0), (1, 0), (3, 0)])      # splits [1 2 3]: [1 2] -> [3], [4]
    assert m.n_nodes() == 3 and m.n_held() == 4
    m.insert(0, [5], [(4, 0)])
    m.match(0, [1, 2, 3], 3)                                # [1 2] and [3] used last
    assert m.evict(1) == [(3, 0)]                           # [4]: the oldest leaf
    assert m.evict(1) == [(4, 0)]                           # [5]
    _, _, h = m.match(0, [1, 2, 3], 3)
    assert m.lock(h) == "ok" and m.evict(10) == [] and m.n_evictable() == 0
    assert m.unlock(h) == "ok" and m.evict(10) == [(2, 0), (0, 0), (1, 0)]
    assert m.n_held() == 0 and not m.roots and not h.alive and m.lock(h) == "arg"
