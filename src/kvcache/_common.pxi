# Shared pieces of the bridge: status -> exception mapping, the per-object lock and operation
# guard, the one argument layer (types, integers, sequence ids, positions, per-layer lists, layer
# filters, value arrays) and the UBatch class.

from cpython.long cimport PyLong_Check, PyLong_CheckExact, PyLong_AsLongLongAndOverflow
from cpython.bool cimport PyBool_Check
from cpython.number cimport PyNumber_Index
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from cpython.buffer cimport PyObject_CheckBuffer
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t, INT32_MAX, INT32_MIN, UINT32_MAX
from libc.string cimport memcpy
from libc.limits cimport LLONG_MIN, LLONG_MAX
from kvcache.includes.kvc_common cimport *
from kvcache.includes.kvc_lock cimport *

import numpy as np
import sys

from kvcache import _signatures


class StateError(ValueError):
    """A state blob is malformed, truncated or does not fit this cache.

    The cache is left exactly as it was before the failed read."""


cdef int raise_status(int status, kvc_err *err, str what) except -1:
    """Turn a negative C status into the matching Python exception."""
    cdef str msg = what
    if err != NULL and err.msg[0] != 0:
        msg = f"{what}: {err.msg.decode('utf-8', 'replace')}"
    if status == KVC_E_NOMEM:
        raise MemoryError(msg)
    if status == KVC_E_STATE:
        raise StateError(msg)
    if status == KVC_E_ARG:
        raise ValueError(msg)
    if status == KVC_E_NOSPACE:
        raise ValueError(msg)
    raise RuntimeError(f"{msg} (internal error {status})")


cdef inline int check_status(int status, kvc_err *err, str what) except -1:
    if status < 0:
        raise_status(status, err, what)
    return 0


# --- locking -----------------------------------------------------------------------------------
# Every object with mutable state (the caches, Batch, SWAPending) carries a kvc_lock
# (csrc/kvc_lock.h: reentrant for its holder; what refuses a change, and why): its Python methods
# hold it for the whole operation, including the loops that run without the GIL. The rule that keeps it free of
# deadlocks with the GIL: nobody blocks on the lock while holding the GIL (lock() waits for a busy
# lock with the GIL released), and several caches are locked in ascending address order. The
# reentrancy is for its holder (an iSWA cache holds both of its caches while calling their
# methods).
#
# Reentrancy must not let a change in under an operation: while an operation of the holder that
# runs Python code is in progress (RUNS_PYTHON: the lock's `busy`), a call of the same thread that
# would change the object (from a callback: a file's write(), an array's hooks, a finalizer the
# garbage collector runs) is refused with RuntimeError; reads are allowed. So is every change to
# a cache while a sequence import holds cells in it (seq_import_begin, counted by the C core).
# A read that makes Python objects between reading the cache and copying out of it (a size read,
# then the array allocated) holds the lock as RUNS_PYTHON too: any allocation may run the garbage
# collector, and with it finalizers that call the cache.
#
# Every locked region is written one way:
#     lock(&self._lock, how, "name")
#     try:
#         ...
#     finally:
#         unlock(&self._lock, how)
# (try/finally costs nothing when nothing raises; a Python-level `with` would cost several times
# a cheap call such as seq_pos_max).
cdef extern from "pythread.h":
    unsigned long PyThread_get_thread_ident() nogil


cdef enum:
    READ = 0          # reads: allowed under an operation of the holder and during an import
    CHANGE = 1        # a change: refused (RuntimeError) under an operation of the holder or an import
    RUNS_PYTHON = 2   # runs Python code while it holds the lock: changes from its callbacks are refused
    REFUSED_AS_BUSY = 4   # with CHANGE: an import's refusal too says raise_busy's words, which name
                          # both reasons (what find_slot of semantics '2025' has always said)


# The size (tokens given, or cells of the sequence) below which a call of a server's step
# (UnifiedCache2026's find_slot, prefix_attach, prefix_release / publish) keeps the GIL while
# its C runs: such a call takes microseconds, and giving the GIL up and taking it back costs
# about 50 ns a call (a step makes a dozen) for no other thread's gain. Larger calls run without
# it, as every long loop does, so that other threads go on meanwhile.
cdef enum:
    SHORT_WORK = 1024


cdef inline bint short_work(size_t work) noexcept nogil:
    """Whether a call of this size keeps the GIL (SHORT_WORK)."""
    return work < SHORT_WORK


cdef int raise_busy(str what) except -1:
    raise RuntimeError(f"{what}: the object is in the middle of another operation of this thread (a "
                       f"callback of that operation called it) or of a sequence import (seq_import_begin: "
                       f"commit or abort it first); nothing was changed")


cdef int raise_importing(str what) except -1:
    raise RuntimeError(f"{what}: a sequence import into this cache is in progress (seq_import_begin); "
                       f"commit or abort it first; nothing was changed")


cdef int _refuse(kvc_lock *l, int why, int how, str what) except -1:
    kvc_lock_release(l)
    if why == KVC_LOCK_BUSY or how & REFUSED_AS_BUSY:
        raise_busy(what)
    raise_importing(what)


cdef inline int lock(kvc_lock *l, int how, str what) except -1:
    """Take l for an operation named what (how: READ, or CHANGE and / or RUNS_PYTHON), waiting
    for it without the GIL; a refused change raises RuntimeError and leaves l as it was. Release
    with unlock(l, how), in a finally clause."""
    cdef uint64_t me = PyThread_get_thread_ident()
    cdef int why
    if not kvc_lock_enter(l, me):
        with nogil:
            kvc_lock_wait(l, me)
    if how & CHANGE:
        why = kvc_lock_refusal(l)
        if why != KVC_LOCK_FREE_TO_CHANGE:
            return _refuse(l, why, how, what)
    if how & RUNS_PYTHON:
        l.busy += 1
    return 0


cdef inline void unlock(kvc_lock *l, int how) noexcept nogil:
    if how & RUNS_PYTHON:
        l.busy -= 1
    kvc_lock_release(l)


cdef inline bint lock_mine(const kvc_lock *l) noexcept nogil:
    """Whether the calling thread holds l."""
    return kvc_lock_mine(l, PyThread_get_thread_ident())


cdef inline int lock_for_cimport(kvc_lock *l) noexcept nogil:
    """lock_c() of the cimport API: 0 once held for a change, -1 (not held) when refused."""
    return 0 if kvc_lock_acquire_change(l, PyThread_get_thread_ident()) == KVC_LOCK_FREE_TO_CHANGE else -1


cdef inline int unlock_for_cimport(kvc_lock *l) noexcept nogil:
    """unlock_c() of the cimport API: 0, or -1 (nothing released) when this thread does not hold l."""
    if not lock_mine(l):
        return -1
    kvc_lock_release(l)
    return 0


# --- the argument layer ------------------------------------------------------------------------
# One set of checks for every entry point, the bridge's methods and the Python modules alike
# (iswa.py, plan.py, geometry.py call the def versions). A value is converted once, from the
# object itself (an int subclass's comparison operators are never consulted), then bounded in
# C. Semantic rules (kv_size a multiple of n_pad, widths whole blocks of the type, ...) are not
# here: the C core checks them and its message reaches the caller.

MAX_SEQ = KVC_MAX_SEQ   # sequence ids of a cache lie in [0, n_seq_max), n_seq_max <= MAX_SEQ


cdef object _NP_INTEGER = np.integer
cdef object _NP_BOOL = np.bool_


cdef inline bint _is_bool(object v):
    return PyBool_Check(v) or isinstance(v, _NP_BOOL)


cdef inline bint _is_int(object v):
    """An int (not a bool) or a numpy integer."""
    return (PyLong_Check(v) and not PyBool_Check(v)) or isinstance(v, _NP_INTEGER)


cdef long long int_c(object v, str name, long long lo, long long hi) except? -1:
    """An integer argument in [lo, hi] (TypeError for bools, floats and non-integers, ValueError
    outside the bounds)."""
    return int_in(v, name, lo, hi, -1)


cdef long long int_in(object v, str name, long long lo, long long hi, long long end) except? -1:
    """int_c, whose ValueError names the range as [lo, end) when end >= 0 (a count's range). The
    value is read once: the message shows the value refused, whatever a later read would give."""
    cdef int overflow = 0
    cdef long long r
    cdef object iv = v
    if PyLong_Check(v) and not PyBool_Check(v):
        r = PyLong_AsLongLongAndOverflow(v, &overflow)      # an int subclass: its value, no method
    elif isinstance(v, _NP_INTEGER):
        iv = PyNumber_Index(v)
        r = PyLong_AsLongLongAndOverflow(iv, &overflow)
    elif _is_bool(v):
        raise TypeError(f"{name} must be an int, not bool")
    else:
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if overflow or r < lo or r > hi:
        # int.__repr__: the value itself, never a subclass's own text
        span = f"[{lo}, {end})" if end >= 0 else f"[{lo}, {hi}]"
        raise ValueError(f"{name} = {int.__repr__(iv)} is outside {span}")
    return r


def int_arg(v, name, lo=None, hi=None):
    """The int argument ``name`` in [lo, hi] (None: no bound beyond int64), as a Python int;
    TypeError for bools, floats and other non-integers, ValueError outside the bounds."""
    return int_c(v, name, LLONG_MIN if lo is None else lo, LLONG_MAX if hi is None else hi)


def n_seq_max_arg(v):
    """The n_seq_max argument by the rule every cache's constructor applies (kvc_n_seq_max_check):
    TypeError for non-integers, ValueError outside it."""
    cdef kvc_err err
    cdef long long n = int_c(v, "n_seq_max", 0, UINT32_MAX)
    if kvc_n_seq_max_check(<uint32_t>n, &err) != KVC_OK:
        raise ValueError(err.msg.decode())
    return n


cdef inline bint bool_c(object v, str name) except -1:
    """A bool argument (bool or numpy bool; TypeError for anything else, ints included)."""
    if v is True:
        return True
    if v is False:
        return False
    if not _is_bool(v):
        raise TypeError(f"{name} must be a bool, not {type(v).__name__}")
    return bool(v)


def bool_arg(v, name):
    """A bool argument (bool or numpy bool; TypeError for anything else, ints included)."""
    return bool_c(v, name)


cdef inline int32_t pos_c(object v, str name) except? -2:
    """A position, bound or shift argument that fits int32."""
    return <int32_t>int_c(v, name, INT32_MIN, INT32_MAX)


cdef inline int32_t divisor_c(object v) except? -2:
    """A position divisor argument ``d``: an int32 above 0."""
    cdef int32_t d = pos_c(v, "d")
    if d <= 0:
        raise ValueError(f"d = {d} must be positive")
    return d


cdef inline int32_t seq_c(object v, uint32_t n_seq_max, str name, bint allow_any) except? -2:
    """A sequence id in [0, n_seq_max), or -1 when allow_any."""
    return <int32_t>int_in(v, name, -1 if allow_any else 0, <long long>n_seq_max - 1, n_seq_max)


def seq_arg(v, n_seq_max, name="seq_id", allow_any=False):
    """A sequence id in [0, n_seq_max) (or -1 with allow_any), as a Python int."""
    return seq_c(v, <uint32_t>int_c(n_seq_max, "n_seq_max", 1, KVC_MAX_SEQ), name, allow_any)


cdef const kvc_type_info *type_c(object t, str name) except NULL:
    """The type-table entry of a ggml type given by name (any case: "f16", "Q8_0") or ggml id."""
    cdef const kvc_type_info *info = NULL
    cdef long long i
    if isinstance(t, str):
        info = kvc_type_by_name(t.lower().encode("ascii", "replace"))
    elif _is_int(t):
        i = int_c(t, name, LLONG_MIN, LLONG_MAX)
        if INT32_MIN <= i <= INT32_MAX:
            info = kvc_type_get(<int32_t>i)
    else:
        raise TypeError(f"{name} must be a ggml type name such as 'f16' or a ggml type id, not "
                        f"{type(t).__name__}")
    if info == NULL:
        names = ", ".join(kvc_type_at(k).name.decode("ascii") for k in range(kvc_type_count()))
        raise ValueError(f"{name} = {t!r}: unknown type (the ggml types kvcache supports: {names})")
    return info


def type_arg(t, name="type"):
    """The GGMLType of a type argument given by name (any case) or ggml id."""
    cdef const kvc_type_info *info = type_c(t, name)
    return GGMLType(info.id, info.name.decode("ascii"), info.blck_size, info.type_size)


cdef list _items(object v):
    """The items of an iterable, in order, as a list, without asking its length first (list(v)
    preallocates what len(v) claims: a subclass claiming 2**62 items made a MemoryError of a
    two-item list). TypeError when v cannot be iterated."""
    return [x for x in v]

def widths_arg(v, n_layer, name, hi=0x7FFFFFFF):
    """Per-layer widths: one int for every layer, or a sequence of n_layer ints, each in
    [0, hi]; a tuple of ints."""
    cdef Py_ssize_t n = <Py_ssize_t>int_c(n_layer, "n_layer", 0, 0x7FFFFFFF)
    cdef long long top = hi
    if _is_int(v):
        return (int_c(v, name, 0, top),) * n
    if isinstance(v, (str, bytes)) or _is_bool(v):
        raise TypeError(f"{name} must be an int or a sequence of ints, not {type(v).__name__}")
    try:
        seq = _items(v)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of ints, not {type(v).__name__}") from None
    if len(seq) != n:
        raise ValueError(f"{name} has {len(seq)} entries, expected one per layer (n_layer = {n})")
    return tuple([int_c(x, f"{name}[{i}]", 0, top) for i, x in enumerate(seq)])


def layers_arg(layers, n_layer, name="layers", any_order=False):
    """Model layers as ascending unique indices in [0, n_layer): from None (all of them), a
    predicate il -> bool, or a sequence of indices (ascending unless any_order; never repeated)."""
    cdef Py_ssize_t n = <Py_ssize_t>int_c(n_layer, "n_layer", 0, 0x7FFFFFFF)
    if layers is None:
        return tuple(range(n))
    if callable(layers):
        return tuple(il for il in range(n) if layers(il))
    if isinstance(layers, (str, bytes)):
        raise TypeError(f"{name} must be None, a callable il -> bool or a sequence of layer indices")
    try:
        seq = list(layers)
    except TypeError:
        raise TypeError(f"{name} must be None, a callable il -> bool or a sequence of layer indices") from None
    out = [int_c(x, f"{name}[{i}]", 0, n - 1) for i, x in enumerate(seq)]
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has repeated entries: {out}")
    if not any_order and out != sorted(out):
        raise ValueError(f"{name} must be ascending: {out}")
    return tuple(sorted(out))


cdef list seq_lists_c(object seq_id, Py_ssize_t n_entries, str unit):
    """Sequence id lists, one per entry (token or token group): each entry an int or a non-empty
    list of ints in [0, MAX_SEQ). TypeError / ValueError name the entry."""
    entries = _seq_entries(seq_id)
    if entries is None:
        raise TypeError(f"seq_id must be a sequence with one entry per {unit}, not {type(seq_id).__name__}")
    if len(entries) != n_entries:
        raise ValueError(f"seq_id has {len(entries)} entries, expected one per {unit} ({n_entries})")
    cdef list lists = []
    cdef Py_ssize_t t
    for t in range(n_entries):
        e = entries[t]
        if _is_int(e):
            lists.append([_seq_id_c(e, t)])
            continue
        if _is_bool(e):
            raise TypeError(f"seq_id[{t}] must be an int or a list of ints, not {type(e).__name__}")
        ids = _seq_entries(e)
        if ids is None:
            raise TypeError(f"seq_id[{t}] must be an int or a list of ints, not {type(e).__name__}")
        if not ids:
            raise ValueError(f"seq_id[{t}] is empty: every {unit} needs a sequence id")
        lists.append([_seq_id_c(x, t) for x in ids])
    return lists


cdef int _seq_id_c(object x, Py_ssize_t t) except -1:
    """One sequence id of entry t, in [0, MAX_SEQ)."""
    cdef int overflow = 0
    cdef long long s
    if not _is_int(x):
        raise TypeError(f"seq_id[{t}] holds {x!r}, not an int")
    iv = PyNumber_Index(x)
    s = PyLong_AsLongLongAndOverflow(iv, &overflow)
    if overflow or s < 0 or s >= KVC_MAX_SEQ:
        raise ValueError(f"seq_id[{t}] holds {int(iv)}, outside [0, {KVC_MAX_SEQ})")
    return <int>s


# what is never a sequence of values: text, raw bytes (their buffer would read as uint8), sets
# and mappings (no order, or keys for values)
from collections.abc import Mapping as _AbcMapping, Set as _AbcSet
cdef tuple _NOT_VALUES = (str, bytes, bytearray, _AbcSet, _AbcMapping)


cdef list _seq_entries(object v):
    """The entries of a sequence-id argument as a list (an integer array by its values), or None
    for what is no sequence of them: text, raw bytes, sets and mappings (no order, or keys for
    values), what cannot be iterated. An array of anything but integers is values_c's TypeError."""
    if isinstance(v, _NOT_VALUES):
        return None
    if PyObject_CheckBuffer(v) or hasattr(v, "__dlpack__"):
        return values_c(v, "seq_id", VALUES_INT, True).tolist()
    try:
        return _items(v)
    except TypeError:
        return None


cdef enum:
    VALUES_INT = 0      # integers (bools refused)
    VALUES_FLAG = 1     # bools or integers
    VALUES_FLOAT = 2    # numbers


cdef object values_c(object v, str name, int kind, bint nd=False):
    """A copy, owned by kvcache, of the values of a buffer-protocol object, a CPU DLPack tensor
    or a sequence of numbers: int64 (VALUES_INT, VALUES_FLAG) or float64 (VALUES_FLOAT),
    one-dimensional unless nd. The copy is taken before anything is checked, so that no later
    change to the caller's object reaches the checks or C; memory is described by the exporter's
    buffer, never by attributes (an object that only claims an __array_interface__ is not an
    array)."""
    cdef str what = "numbers" if kind == VALUES_FLOAT else ("bools or ints" if kind == VALUES_FLAG else "integers")
    if isinstance(v, _NOT_VALUES):
        raise TypeError(f"{name} must be a sequence of {what} or an array, not {type(v).__name__}")
    if PyObject_CheckBuffer(v) or hasattr(v, "__dlpack__"):
        a = host_array(v, name)
        floats = _holds_floats(a.dtype)
        ok = (a.dtype.kind in "iu" and not floats) or (kind == VALUES_FLAG and a.dtype == np.bool_) or \
            (kind == VALUES_FLOAT and floats)
        if not ok and (a.size or a.dtype == np.bool_ or a.dtype.kind not in "iufb"):
            raise TypeError(f"{name} must hold {what}, got dtype {_dtype_name(a.dtype)}")
        if not nd and a.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
        if kind == VALUES_FLOAT:
            return np.array(_decoded(a), dtype=np.float64, copy=True)
        if a.dtype == np.uint64 and a.size and int(a.max()) > 2**63 - 1:
            raise ValueError(f"{name} holds values beyond int64")
        return np.array(a, dtype=np.int64, copy=True)
    try:
        items = _items(v)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {what} or an array, not {type(v).__name__}") from None
    cdef Py_ssize_t i, n = len(items)
    if kind == VALUES_FLOAT:
        if nd:
            return np.array([values_c(x, name, kind, True) if isinstance(x, (list, tuple)) else _float_c(x, name)
                             for x in items], dtype=np.float64)
        return np.array([_float_c(x, name) for x in items], dtype=np.float64)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        x = items[i]
        if kind == VALUES_FLAG and _is_bool(x):
            out[i] = 1 if x else 0
        elif _is_int(x):
            out[i] = int_c(x, f"{name}[{i}]", LLONG_MIN, LLONG_MAX)
        elif isinstance(x, (list, tuple)) or PyObject_CheckBuffer(x):
            raise ValueError(f"{name} must be one-dimensional ({name}[{i}] is a sequence)")
        else:
            raise TypeError(f"{name} must hold {what}, not {type(x).__name__} ({name}[{i}])")
    return out


cdef double _float_c(object x, str name) except? -1.0:
    if _is_bool(x) or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must hold numbers, not {type(x).__name__}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must hold numbers, not {type(x).__name__}") from None


# --- the ggml type table, read-only (csrc/kvc_types.h is the one copy) ---------------------------

from collections import namedtuple as _namedtuple

GGMLType = _namedtuple("GGMLType", "id name blck_size type_size")
GGMLType.__doc__ = "A ggml tensor type: id, name, elements per block, bytes per block."


def ggml_types():
    """The ggml types a cache can hold, by ascending id: a tuple of GGMLType."""
    cdef size_t i
    cdef const kvc_type_info *t
    found = []
    for i in range(kvc_type_count()):
        t = kvc_type_at(i)
        found.append(GGMLType(t.id, t.name.decode("ascii"), t.blck_size, t.type_size))
    return tuple(sorted(found))


def ggml_type(t):
    """The GGMLType of a type given by name ("f16", "Q8_0", ...) or ggml id (ValueError if unknown)."""
    return type_arg(t, "type")


def ggml_row_size(t, n):
    """Bytes of a row of n elements of type t (name or id), as ggml_row_size.

    ValueError when n is negative or not a whole number of the type's blocks."""
    cdef const kvc_type_info *info = type_c(t, "type")
    cdef long long m = int_c(n, "n", 0, LLONG_MAX)
    if m % info.blck_size:
        raise ValueError(f"{info.name.decode()} rows hold whole blocks of {info.blck_size} elements; "
                         f"{m} is not a multiple")
    return kvc_row_size(info.id, <uint64_t>m)


cdef extern from "Python.h":
    # the items of an exact list or tuple, read without a reference taken (no Python code runs
    # while they are read: a list changes only under Python code)
    PyObject **_seq_items "PySequence_Fast_ITEMS" (object)
    Py_ssize_t _seq_size "PySequence_Fast_GET_SIZE" (object)
    bint _int_exact "PyLong_CheckExact" (PyObject *)
    long long _int_ll "PyLong_AsLongLongAndOverflow" (PyObject *, int *)


cdef extern from *:
    """
    /* An exact int's value when it fits one digit (every position, id and token a ubatch
     * carries), read inline; *big set for any other (PyLong_AsLongLongAndOverflow reads it). */
    static inline long long kvc_py_small_int(PyObject *o, int *big) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *big = 0;
            return (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
        }
    #else
        const Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            *big = 0;
            return (long long)size * (long long)((PyLongObject *)o)->ob_digit[0];
        }
    #endif
        *big = 1;
        return 0;
    }
    """
    long long _int_small "kvc_py_small_int" (PyObject *, int *) noexcept nogil


cdef object _flat_ints(object v):
    """v itself when it is a list or tuple of plain ints, an ndarray over v's memory when v is a
    one-dimensional native int32 / int64 array (buffer or CPU tensor), else None (the general
    path handles it, with its messages)."""
    cdef Py_ssize_t i, n
    cdef PyObject **items
    if type(v) is list or type(v) is tuple:
        items = _seq_items(v)
        n = _seq_size(v)
        for i in range(n):
            if not _int_exact(items[i]):
                return None
        return v
    if type(v) is _NDARRAY:
        dt = v.dtype   # exactly an ndarray: only numpy's own C runs (as host_array reads it)
        if v.ndim == 1 and (dt is _I32 or dt is _I64 or dt == _I32 or dt == _I64):
            return v
        return None
    if PyObject_CheckBuffer(v) or hasattr(v, "__dlpack__"):
        a = host_array(v, "ubatch values")
        dt = a.dtype
        if a.ndim == 1 and (dt is _I32 or dt is _I64 or dt == _I32 or dt == _I64):
            return a
    return None


cdef inline int _ints_range(const int32_t *src, int32_t *dst, Py_ssize_t n,
                            long long *lo_out, long long *hi_out) noexcept nogil:
    # min / max of n contiguous int32 values, copied to dst (a loop the compiler vectorizes)
    cdef Py_ssize_t j
    cdef int32_t lo = src[0], mx = src[0], x
    for j in range(n):
        x = src[j]
        lo = x if x < lo else lo
        mx = x if x > mx else mx
        dst[j] = x
    lo_out[0], hi_out[0] = lo, mx
    return 0


cdef inline int _ints_range64(const int64_t *src, int32_t *dst, Py_ssize_t n,
                              long long *lo_out, long long *hi_out) noexcept nogil:
    cdef Py_ssize_t j
    cdef int64_t lo = src[0], mx = src[0], x
    for j in range(n):
        x = src[j]
        lo = x if x < lo else lo
        mx = x if x > mx else mx
        dst[j] = <int32_t>x
    lo_out[0], hi_out[0] = lo, mx
    return 0


cdef int _ints_into(object v, int32_t *dst, Py_ssize_t n, long long hi, str name) except -2:
    """Copy n values of a _flat_ints result into dst, each read once and checked to lie in
    [0, hi] (ValueError naming the entry). Returns the largest value (-1 when n is 0)."""
    cdef Py_ssize_t j = 0, step
    cdef long long x, lo
    cdef long long mx = -1
    cdef int overflow = 0, big = 0
    cdef Py_buffer view
    cdef const char *p
    cdef PyObject **items
    if type(v) is list or type(v) is tuple:
        # plain ints (what _flat_ints saw): read straight from the items; an item that is no
        # longer one (Python code changed the list since) goes the general way from there on
        if _seq_size(v) >= n:
            items = _seq_items(v)
            while j < n and _int_exact(items[j]):
                x = _int_small(items[j], &big)
                if big:
                    x = _int_ll(items[j], &overflow)
                if overflow or x < 0 or x > hi:
                    _ints_refuse(<object>items[j], j, hi, name)
                dst[j] = <int32_t>x
                if x > mx:
                    mx = x
                j += 1
        while j < n:
            x = PyLong_AsLongLongAndOverflow(v[j], &overflow)
            if overflow or x < 0 or x > hi:
                _ints_refuse(v[j], j, hi, name)
            dst[j] = <int32_t>x
            if x > mx:
                mx = x
            j += 1
        return <int>mx
    # an int32 or int64 ndarray (_flat_ints): read through its buffer, as numpy describes it
    PyObject_GetBuffer(v, &view, PyBUF_STRIDES)
    try:
        if view.ndim != 1 or view.shape[0] != n or (view.itemsize != 4 and view.itemsize != 8):
            raise ValueError(f"{name}: expected {n} int32 or int64 values")
        step = view.strides[0] if view.strides != NULL else view.itemsize
        p = <const char *>view.buf
        if n and step == view.itemsize:
            # contiguous: copied and its range taken in one pass; an entry out of range is looked
            # for only when there is one (each entry is still read once into dst)
            if step == 4:
                _ints_range(<const int32_t *>p, dst, n, &lo, &mx)
            else:
                _ints_range64(<const int64_t *>p, dst, n, &lo, &mx)
            if lo >= 0 and mx <= hi:
                return <int>mx
            # the first entry out of range, for the message (int32: as copied)
            for j in range(n):
                x = dst[j] if step == 4 else (<const int64_t *>p)[j]
                if x < 0 or x > hi:
                    _ints_refuse(x, j, hi, name)
            raise ValueError(f"{name} holds values in [{lo}, {mx}], outside [0, {hi + 1})")
        for j in range(n):
            if view.itemsize == 4:
                x = (<const int32_t *>(p + j * step))[0]
            else:
                x = (<const int64_t *>(p + j * step))[0]
            if x < 0 or x > hi:
                _ints_refuse(x, j, hi, name)
            dst[j] = <int32_t>x
            if x > mx:
                mx = x
    finally:
        PyBuffer_Release(&view)
    return <int>mx


cdef int _ints_refuse(object x, Py_ssize_t j, long long hi, str name) except -1:
    raise ValueError(f"{name}[{j}] holds {int(x)}, outside [0, {hi + 1})")


_I32 = np.dtype(np.int32)
cdef object _NDARRAY = np.ndarray
cdef object _UNBOUND = object()   # a required argument no argument of the call gave


cdef inline object _kwarg(dict kwargs, str name, object value, Py_ssize_t *taken):
    """kwargs[name] when the call gave it (counted in taken), else value."""
    v = kwargs.get(name, _UNBOUND)
    if v is _UNBOUND:
        return value
    taken[0] += 1
    return v
_I64 = np.dtype(np.int64)


cdef str _group_unit(uint32_t nst):
    """What one entry of a ubatch's seq_id stands for, in its messages (worded only when one is
    raised: a server builds a ubatch per step)."""
    return "token" if nst == 1 else f"group of n_seq_tokens={nst} tokens"


cdef class UBatch:
    """A ubatch: the tokens placed into a cache in one step.

    ``UBatch(pos, seq_id, n_seq_tokens=1, output=None)``

    - ``pos``: one position per token (ints in [0, 2**31)): a sequence, an integer array or a
      CPU tensor.
    - ``seq_id``: one entry per token group; an entry is an int or a list of ints (the first id
      of a group is the one its mask rows use). With ``n_seq_tokens == 1`` (simple split) every
      token is its own group; otherwise the tokens are ``len(seq_id)`` groups of
      ``n_seq_tokens`` consecutive tokens (equal split).
    - ``output``: optional per-token output flags (kept for the caller; caches ignore them).
    - ``tokens``: optional token ids, one per token (int32; llama.cpp's ``ubatch.token``).
    - ``pos_x``, ``pos_y``: optional 2-D positions, one each per token (both or neither): the
      ubatch has 2-D positions (M-RoPE: llama.cpp's position planes 2 and 1, ``pos`` being plane
      0). A cache with the per-cell extension (``cell_ext=True``) stores them and the token ids
      in the cells it places them in; the KQ mask of a ubatch with 2-D positions also hides, at
      the token's own position, the cells whose 2-D position comes after the token's. Other
      caches ignore ``tokens`` and refuse 2-D positions.

    The values are copied into memory the ubatch owns: changing the arguments afterwards does
    not change it. Read-only attributes: ``n_tokens``, ``n_seq_tokens``, ``n_seqs``, ``pos``,
    ``seq_id``, ``output`` (bool array or None), ``tokens``, ``pos_x``, ``pos_y`` (int32 arrays
    or None) and ``max_seq`` (the largest sequence id, -1 when none).
    """

    __signature__ = _signatures.ClassSignature(_signatures.ubatch)

    def __cinit__(self, *args, **kwargs):
        cdef Py_ssize_t n_tokens, n_groups, g, total
        # the arguments bound here as _signatures.ubatch binds them (a server builds a ubatch per
        # step): any call that does not fit goes to _signatures.bind, which words the error
        cdef Py_ssize_t na = len(args), taken = 0
        pos = args[0] if na > 0 else _UNBOUND
        seq_id = args[1] if na > 1 else _UNBOUND
        n_seq_tokens = args[2] if na > 2 else 1
        output = args[3] if na > 3 else None
        tokens = pos_x = pos_y = None
        if kwargs:
            # a keyword that repeats a positional argument, or that no parameter has, is not taken;
            # tokens first: a server's ubatch gives it alone
            tokens = _kwarg(kwargs, "tokens", None, &taken)
            if taken < len(kwargs):
                if na < 1:
                    pos = _kwarg(kwargs, "pos", pos, &taken)
                if na < 2:
                    seq_id = _kwarg(kwargs, "seq_id", seq_id, &taken)
                if na < 3:
                    n_seq_tokens = _kwarg(kwargs, "n_seq_tokens", n_seq_tokens, &taken)
                if na < 4:
                    output = _kwarg(kwargs, "output", output, &taken)
                pos_x = _kwarg(kwargs, "pos_x", None, &taken)
                pos_y = _kwarg(kwargs, "pos_y", None, &taken)
        if na > 4 or taken != len(kwargs) or pos is _UNBOUND or seq_id is _UNBOUND:
            pos, seq_id, n_seq_tokens, output, tokens, pos_x, pos_y = _signatures.bind(
                _signatures.ubatch, type(self), args, kwargs)
        cdef uint32_t nst = <uint32_t>int_c(n_seq_tokens, "n_seq_tokens", 1, UINT32_MAX)
        # pos and (when it is one id per group) seq_id as int32/int64 arrays or lists of ints
        # are read once, value by value, straight into the ubatch's block, checked as they are
        # copied; anything else is first copied by values_c / seq_lists_c
        pos_v = _flat_ints(pos)
        if pos_v is None:
            pos_v = values_c(pos, "pos", VALUES_INT)
        n_tokens = len(pos_v)
        if n_tokens > <Py_ssize_t>UINT32_MAX:
            raise ValueError(f"too many tokens ({n_tokens})")
        if n_tokens % nst:
            raise ValueError(f"pos has {n_tokens} tokens, not a whole number of groups of "
                             f"n_seq_tokens={nst}")
        lists = None
        ids_v = _flat_ints(seq_id)
        if ids_v is not None and len(ids_v) != n_tokens // nst:
            raise ValueError(f"seq_id has {len(ids_v)} entries, expected one per {_group_unit(nst)} "
                             f"({n_tokens // nst})")
        if ids_v is None:
            lists = seq_lists_c(seq_id, n_tokens // nst, _group_unit(nst))
            n_groups = len(lists)
            total = 0
            for g in range(n_groups):
                total += len(lists[g])
        else:
            n_groups = total = len(ids_v)
        flags = None
        if output is not None:
            flags = values_c(output, "output", VALUES_FLAG)
            if flags.shape != (n_tokens,):
                raise ValueError(f"output must have one flag per token ({n_tokens}), got shape {flags.shape}")
            flags = flags != 0
        # token ids alone (a server's ubatch) go into the ubatch's block, read once and checked as
        # they are copied; anything else (2-D positions, a negative id) goes through _ext_values
        tok_v = None
        if (type(tokens) is _NDARRAY or type(tokens) is list) and pos_x is None and pos_y is None and n_tokens:
            tok_v = _flat_ints(tokens)
            if tok_v is not None and len(tok_v) != n_tokens:
                tok_v = None
        # one block owned by the ubatch: seq_off (never empty, so it marks the block), pos, seq_ids
        # and, on that path, the token ids
        cdef size_t nbytes = (<size_t>n_groups + 1) * 4 + <size_t>n_tokens * 4 + <size_t>total * 4
        if tok_v is not None:
            nbytes += <size_t>n_tokens * 4
        cdef uint8_t *mem = <uint8_t *>PyMem_Malloc(nbytes)
        if mem == NULL:
            raise MemoryError("UBatch")
        cdef uint32_t *off = <uint32_t *>mem
        self.c.seq_off = off            # owned from here on (freed by __dealloc__)
        cdef int32_t *pos_p = <int32_t *>(mem + (<size_t>n_groups + 1) * 4)
        cdef int32_t *ids = <int32_t *>(<uint8_t *>pos_p + <size_t>n_tokens * 4)
        self.c.n_tokens = 0             # nothing readable until the values are in
        self.c.n_seqs = 0
        off[0] = 0
        _ints_into(pos_v, pos_p, n_tokens, INT32_MAX, "pos")
        cdef int x
        cdef int mx = -1
        if ids_v is not None:
            mx = _ints_into(ids_v, ids, n_groups, KVC_MAX_SEQ - 1, "seq_id")
            for g in range(n_groups):
                off[g + 1] = <uint32_t>(g + 1)
        else:
            total = 0
            for g in range(n_groups):
                for x in lists[g]:
                    ids[total] = x
                    if x > mx:
                        mx = x
                    total += 1
                off[g + 1] = <uint32_t>total
        self.output = flags
        self.c.n_tokens = <uint32_t>n_tokens
        self.c.n_seq_tokens = nst
        self.c.n_seqs = <uint32_t>n_groups
        self.c.pos = pos_p if n_tokens else NULL
        self.c.seq_ids = ids
        self.max_seq = mx
        self._ext = None
        if tok_v is not None:
            try:
                _ints_into(tok_v, ids + total, n_tokens, INT32_MAX, "tokens")
                self.c.token = ids + total
                return
            except ValueError:
                pass   # a negative id: _ext_values decides
        if tokens is not None or pos_x is not None or pos_y is not None:
            _ubatch_set_ext(self, tokens, pos_x, pos_y, n_tokens)

    @property
    def tokens(self):
        """Token ids (a read-only int32 array), or None."""
        if self.c.token == NULL:
            return None
        if self._ext is not None:
            return self._ext[2, :self.c.n_tokens]
        out = np.empty(self.c.n_tokens, dtype=np.int32)   # in the ubatch's block (__cinit__)
        cdef int32_t[::1] o = out
        memcpy(&o[0], self.c.token, self.c.n_tokens * sizeof(int32_t))
        out.flags.writeable = False
        return out

    @property
    def pos_x(self):
        """The x of each token's 2-D position (a read-only int32 array), or None."""
        return self._ext[0, :self.c.n_tokens] if self.c.pos_x != NULL else None

    @property
    def pos_y(self):
        """The y of each token's 2-D position (a read-only int32 array), or None."""
        return self._ext[1, :self.c.n_tokens] if self.c.pos_y != NULL else None

    def __dealloc__(self):
        # the block the ubatch owns starts at seq_off (NULL before __cinit__ allocated it)
        PyMem_Free(<void *>self.c.seq_off)

    @property
    def n_tokens(self) -> int:
        """Number of tokens."""
        return self.c.n_tokens

    @property
    def n_seq_tokens(self) -> int:
        """Tokens per group (1 for a simple split)."""
        return self.c.n_seq_tokens

    @property
    def n_seqs(self) -> int:
        """Number of token groups."""
        return self.c.n_seqs

    @property
    def pos(self):
        """Positions (a read-only int32 array, a copy)."""
        out = np.empty(self.c.n_tokens, dtype=np.int32)
        cdef int32_t[::1] o = out
        if self.c.n_tokens:
            memcpy(&o[0], self.c.pos, self.c.n_tokens * sizeof(int32_t))
        out.flags.writeable = False
        return out

    @property
    def seq_id(self):
        """Sequence ids of each group (list of lists)."""
        cdef uint32_t g, j
        return [[self.c.seq_ids[j] for j in range(self.c.seq_off[g], self.c.seq_off[g + 1])]
                for g in range(self.c.n_seqs)]

    def __len__(self):
        return self.c.n_tokens

    def __repr__(self):
        return f"UBatch(n_tokens={self.c.n_tokens}, n_seq_tokens={self.c.n_seq_tokens}, n_seqs={self.c.n_seqs})"

    cdef int check(self, uint32_t n_seq_max, bint cell_ext=False) except -1:
        """Check the ids against a cache's n_seq_max (ValueError naming the bad id); 2-D
        positions need a cache with the per-cell extension (cell_ext). The rest of what a cache
        relies on (groups, positions, ids below MAX_SEQ) was checked as the values were copied
        into memory only the ubatch holds: it is not read again here."""
        if self.c.pos_x != NULL and not cell_ext:
            raise ValueError("a ubatch with 2-D positions (pos_x, pos_y) needs a cache with the per-cell "
                             "extension (cell_ext=True)")
        if self.max_seq >= <int>n_seq_max:
            raise ValueError(f"seq_id {self.max_seq} in the ubatch is outside [0, {n_seq_max})")
        return 0


cdef UBatch ubatch_c(object ub):
    """A ubatch argument (``ub``) as the UBatch it must be; TypeError in the user's words
    otherwise (a typed parameter's own error names the module's internals)."""
    if not isinstance(ub, UBatch):
        raise TypeError(f"ub must be a kvcache.UBatch, not {type(ub).__name__}")
    return <UBatch>ub


cdef object _ext_values(object tokens, object pos_x, object pos_y, Py_ssize_t n_tokens):
    """The optional per-token values of a UBatch or a Batch, checked: an int32 [3, n_tokens]
    array (rows pos_x, pos_y, tokens; rows not given are 0) and which rows were given."""
    if (pos_x is None) != (pos_y is None):
        raise ValueError("pos_x and pos_y: a 2-D position needs both (or neither)")
    ext = np.zeros((3, max(n_tokens, 1)), dtype=np.int32)
    cdef int32_t[:, ::1] ev = ext
    for k, (v, name) in enumerate(((pos_x, "pos_x"), (pos_y, "pos_y"), (tokens, "tokens"))):
        if v is None:
            continue
        # the common case without the general conversion: plain ints, or an int32 / int64 array
        f = _flat_ints(v)
        if f is not None and len(f) == n_tokens:
            try:
                if n_tokens:
                    _ints_into(f, &ev[k, 0], n_tokens, INT32_MAX, name)
                continue
            except ValueError:
                pass   # a negative value: the general path below decides
        a = values_c(v, name, VALUES_INT)
        if a.shape != (n_tokens,):
            raise ValueError(f"{name} must have one value per token ({n_tokens}), got shape {a.shape}")
        if n_tokens and (a.min() < INT32_MIN or a.max() > INT32_MAX):
            raise ValueError(f"{name} values must be int32")
        ext[k, :n_tokens] = a
    ext.flags.writeable = False
    return ext, (pos_x is not None, tokens is not None)


cdef int _ubatch_set_ext(UBatch self, object tokens, object pos_x, object pos_y, Py_ssize_t n_tokens) except -1:
    """The optional per-token values of a UBatch (int32 [3, n_tokens] it owns: pos_x, pos_y, tokens)."""
    ext, (has_xy, has_tok) = _ext_values(tokens, pos_x, pos_y, n_tokens)
    cdef const int32_t[:, ::1] e = ext
    self._ext = ext
    self.c.pos_x = &e[0, 0] if has_xy else NULL
    self.c.pos_y = &e[1, 0] if has_xy else NULL
    self.c.token = &e[2, 0] if has_tok else NULL
    return 0


def _fail_alloc_after(n=None):
    """Test hook of the C core: make its n-th allocation from now on fail (once); 0 disarms
    it, None leaves it as it is. Returns the count pending before the call: 0 once the armed
    allocation was reached, > 0 when fewer allocations happened since it was armed.

    For tests that run one thread: the count is a plain global of the C core."""
    global kvc_fail_alloc_after
    cdef int old = kvc_fail_alloc_after
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, not {type(n).__name__}")
        if not 0 <= n <= 0x7FFFFFFF:
            raise ValueError(f"n = {n} is outside [0, 2**31)")
        kvc_fail_alloc_after = <int>n
    return old
