# K/V memory: the three ownership modes, element dtypes, borrowed buffers (buffer protocol
# or DLPack on the CPU) and the DLPack export of bf16 views.

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBuffer_IsContiguous, PyBUF_STRIDES,
                             PyBUF_WRITABLE)
from cpython.pycapsule cimport (PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer,
                                PyCapsule_SetName)
from cpython.ref cimport Py_INCREF, Py_DECREF
from libc.stdint cimport int64_t, uint16_t, uintptr_t
from libc.stdlib cimport malloc, free
from weakref import ref as _weakref

try:
    import ml_dtypes as _ml_dtypes
    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except (ImportError, AttributeError):
    # optional: bf16 views are then uint16 bit patterns (a module blocked as None in sys.modules
    # comes back here as None)
    _BF16 = None

_MEM_ALIGN = 64   # byte alignment of owned K/V memory (cache lines, SIMD loads)
_DL_CPU = 1       # DLPack device type of host memory
_DL_BFLOAT = 4    # DLPack type code of bfloat16


cdef size_t _data_address(object arr) except? 0:
    """Where an array's data starts, as arr.ctypes.data says, without making the ctypes object
    (a few microseconds each; a cache's constructor asks it of every K/V buffer)."""
    cdef Py_buffer view
    PyObject_GetBuffer(arr, &view, PyBUF_STRIDES)
    cdef size_t addr = <size_t>view.buf
    PyBuffer_Release(&view)
    return addr


def _aligned_zeros(size_t nbytes):
    """A zeroed uint8 array of nbytes whose data starts on a _MEM_ALIGN boundary; from 4 MiB on,
    on a huge-page boundary with huge pages requested (kvc_advise_huge_pages): the owned K/V
    memory. The zeros are mapped lazily, so the alignment slack costs no memory."""
    cdef size_t align = _MEM_ALIGN if nbytes < 2 * KVC_HUGE_PAGE else KVC_HUGE_PAGE
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    cdef size_t off = (align - _data_address(raw) % align) % align
    out = raw[off:off + nbytes]
    if align != _MEM_ALIGN:
        kvc_advise_huge_pages(<void *><uintptr_t>_data_address(out), nbytes)
    return out


_F32, _F16, _U16, _U8 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16), np.dtype(np.uint8)


cdef object _element_dtype(int32_t type_id):
    """numpy dtype of the k()/v() views of a type: float32, float16, bfloat16 (ml_dtypes; uint16
    bit patterns without it), uint8 bytes for block-quantized types."""
    if type_id == KVC_TYPE_F32:
        return _F32
    if type_id == KVC_TYPE_F16:
        return _F16
    if type_id == KVC_TYPE_BF16:
        return _BF16 if _BF16 is not None else _U16
    return _U8


def view_dtype(type):
    """The numpy dtype of ``k(il)`` / ``v(il)`` for a ggml type name or id: float32 (f32),
    float16 (f16), ``ml_dtypes.bfloat16`` (bf16; uint16 bit patterns when ml_dtypes is not
    installed), uint8 rows of the type's row size for block-quantized types."""
    cdef const kvc_type_info *info = type_c(type, "type")
    return _element_dtype(info.id)


cdef object _buffers_mode(object buffers):
    """'owned', 'none' or 'borrowed' from a constructor's buffers argument."""
    if buffers is None:
        return "none"
    if isinstance(buffers, str):
        if buffers in ("owned", "none"):
            return buffers
        raise ValueError(f"buffers = {buffers!r}: expected 'owned', None / 'none' (metadata only), "
                         f"or the per-layer (K, V) buffers to borrow")
    if isinstance(buffers, (dict, list, tuple)):
        return "borrowed"
    raise TypeError(f"buffers must be 'owned', None, 'none', a dict {{layer: (K, V)}} or a list of "
                    f"(K, V) pairs, not {type(buffers).__name__}")


cdef list _buffer_pairs(object buffers, tuple layers):
    """The (K, V) objects of each kept layer, in cache order, from a dict keyed by model layer
    or a sequence with one pair per kept layer."""
    if isinstance(buffers, dict):
        for key in buffers:
            if key not in layers:
                raise ValueError(f"buffers has an entry for layer {key!r}, which is not a kept layer "
                                 f"(layers: {list(layers)})")
        missing = [il for il in layers if il not in buffers]
        if missing:
            raise ValueError(f"buffers has no entry for layer(s) {missing}")
        items = [buffers[il] for il in layers]
    else:
        items = list(buffers)
        if len(items) != len(layers):
            raise ValueError(f"buffers has {len(items)} entries, expected one (K, V) pair per kept "
                             f"layer ({len(layers)}: {list(layers)})")
    out = []
    for il, pair in zip(layers, items):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise TypeError(f"buffers[{il}] must be a (K, V) pair, not {type(pair).__name__}")
        out.append((pair[0], pair[1]))
    return out


# --- DLPack (the stable, unversioned ABI) ----------------------------------------------------

cdef struct _DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct _DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct _DLTensor:
    void *data
    _DLDevice device
    int32_t ndim
    _DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

cdef struct _DLManagedTensor:
    _DLTensor dl_tensor
    void *manager_ctx
    void (*deleter)(_DLManagedTensor *) noexcept


cdef class _DLPackMemory:
    """Host memory received through a DLPack capsule: exposes its bytes through the buffer
    protocol and calls the producer's deleter when the last view of it goes away."""
    cdef _DLManagedTensor *mt
    cdef char *ptr
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer *buf, int flags):
        self.shape[0] = self.nbytes
        self.strides[0] = 1
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.nbytes
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def __dealloc__(self):
        if self.mt != NULL and self.mt.deleter != NULL:
            self.mt.deleter(self.mt)
        self.mt = NULL


# DLPack bfloat16 without ml_dtypes: uint16 bit patterns under a dtype that says so (numpy has no
# bfloat16 of its own), so that readers of integers refuse them and readers of numbers decode them
_BF16_BITS = np.dtype(np.uint16, metadata={"kvcache": "bfloat16"})


cdef bint _is_bf16_bits(object dt):
    md = dt.metadata
    return md is not None and md.get("kvcache") == "bfloat16"


cdef bint _holds_floats(object dt):
    """Whether elements of dtype dt are floating-point numbers: numpy's floats and bfloat16
    (ml_dtypes, or the bit patterns of a DLPack bfloat16 tensor without it)."""
    return dt.kind == "f" or _is_bf16_bits(dt) or (_BF16 is not None and dt == _BF16)


cdef str _dtype_name(object dt):
    return "bfloat16" if _is_bf16_bits(dt) else str(dt)


cdef object _decoded(object a):
    """a's values: the bit patterns of a DLPack bfloat16 tensor (no ml_dtypes) decoded into a
    float32 copy, any other array as it is."""
    if not _is_bf16_bits(a.dtype):
        return a
    src = np.ascontiguousarray(a, dtype=np.uint16)
    out = np.empty(src.shape, dtype=np.float32)
    cdef const uint16_t[::1] s = src.reshape(-1)
    cdef float[::1] d = out.reshape(-1)
    cdef Py_ssize_t i, n = s.shape[0]
    with nogil:
        for i in range(n):
            d[i] = kvc_bf16_to_f32(s[i])
    return out


cdef object _dl_dtype(_DLDataType t, str name):
    if t.lanes != 1:
        raise TypeError(f"{name}: vector DLPack types (lanes = {t.lanes}) are not supported")
    if t.code == _DL_BFLOAT and t.bits == 16:
        return _BF16 if _BF16 is not None else _BF16_BITS
    kinds = {0: "i", 1: "u", 2: "f"}
    if t.code in kinds and t.bits in (8, 16, 32, 64):
        return np.dtype(f"{kinds[t.code]}{t.bits // 8}")
    raise TypeError(f"{name}: DLPack type code {t.code} with {t.bits} bits is not supported")


cdef object _from_dlpack_capsule(object obj, str name):
    """A numpy array over the memory of obj's legacy DLPack capsule (for the dtypes numpy's
    own from_dlpack refuses, bfloat16 among them). The array must be C-contiguous."""
    cap = obj.__dlpack__()
    if not PyCapsule_IsValid(cap, "dltensor"):
        raise TypeError(f"{name}: __dlpack__() did not return a DLPack capsule")
    cdef _DLManagedTensor *mt = <_DLManagedTensor *>PyCapsule_GetPointer(cap, "dltensor")
    cdef _DLPackMemory mem = _DLPackMemory.__new__(_DLPackMemory)
    # from here on the capsule's tensor is ours to release (mem's deleter call)
    PyCapsule_SetName(cap, "used_dltensor")
    mem.mt = mt
    cdef _DLTensor *t = &mt.dl_tensor
    cdef int i
    if t.device.device_type != _DL_CPU:
        raise TypeError(f"{name} is on DLPack device {t.device.device_type}, not the CPU")
    dt = _dl_dtype(t.dtype, name)
    if t.ndim < 0 or t.ndim > 32:
        raise TypeError(f"{name}: DLPack tensor of {t.ndim} dimensions")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if any(d < 0 for d in shape):
        raise TypeError(f"{name}: DLPack tensor of shape {shape}")
    expect = 1
    if t.strides != NULL:
        for i in range(t.ndim - 1, -1, -1):
            if t.shape[i] != 1 and t.strides[i] != expect:
                raise ValueError(f"{name} must be C-contiguous")
            expect *= t.shape[i]
    n = 1
    for d in shape:
        n *= d
    if n * dt.itemsize > 2**62:
        raise TypeError(f"{name}: DLPack tensor of shape {shape} is too large")
    mem.ptr = <char *>t.data + t.byte_offset
    mem.nbytes = n * dt.itemsize
    return np.frombuffer(mem, dtype=np.uint8).view(dt).reshape(shape)


# --- the buffer edge: every array argument goes through here -------------------------------------

cdef str _text(object x):
    """A name or layout of an error message: a str, or a tuple (format, *args) formatted now
    (callers pass tuples so that nothing is formatted unless a message is raised)."""
    return x if isinstance(x, str) else x[0].format(*x[1:])


cdef object _torch_tensor = None    # torch.Tensor, once torch is imported (kvcache never imports it)
cdef object _torch_is_neg = None    # torch.Tensor.is_neg (None in a torch without it)


cdef object _torch_cpu_array(object obj, str name):
    """A numpy array over an exact torch.Tensor's memory, from torch's own Tensor.numpy (called
    through the class: an attribute set on the instance is not consulted), or None when torch
    refuses (a device tensor, bfloat16, one that requires grad, ...) or obj is a subclass, and
    the DLPack route must decide. A fraction of the DLPack route's cost: a decode step passes
    several small tensors. TypeError for a tensor whose negative bit is set: its memory holds
    the values negated, and DLPack would export that memory as it is."""
    global _torch_tensor, _torch_is_neg
    if _torch_tensor is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        tensor = getattr(torch, "Tensor", None)
        if tensor is None:
            return None
        _torch_is_neg = getattr(tensor, "is_neg", None)
        _torch_tensor = tensor
    if not isinstance(obj, _torch_tensor):
        return None
    if _torch_is_neg is not None and _torch_is_neg(obj):
        raise TypeError(f"{name} has the negative bit set (its memory holds the values negated): pass "
                        f"tensor.resolve_neg()")
    if type(obj) is not _torch_tensor:
        return None
    try:
        a = _torch_tensor.numpy(obj)
    except (TypeError, RuntimeError, ValueError):
        return None
    return a if type(a) is np.ndarray else None


cdef object host_array(object obj, str name):
    """A numpy array, of exactly the ndarray type, over the memory of obj (nothing is copied):
    an ndarray (its own C description: a subclass's properties and hooks are never consulted),
    a buffer-protocol object (as its exporter describes it) or a CPU tensor with __dlpack__
    (as the producer's C struct describes it). TypeError for anything else: an object that
    only claims memory through __array_interface__ is not an array; and for device tensors."""
    if type(obj) is np.ndarray:
        return obj           # exactly an ndarray: nothing of it but numpy's own C runs
    if isinstance(obj, np.ndarray):
        return np.ndarray.view(obj, type=np.ndarray)
    if PyObject_CheckBuffer(obj):
        try:
            m = memoryview(obj)
        except (TypeError, NotImplementedError, BufferError) as e:
            raise TypeError(f"{name}: unsupported buffer ({e})") from None
        try:
            return np.asarray(m)
        except (TypeError, ValueError, NotImplementedError, BufferError) as e:
            raise TypeError(f"{name}: unsupported buffer ({e})") from None
    a = _torch_cpu_array(obj, name)
    if a is not None:
        return a
    if hasattr(obj, "__dlpack__"):
        try:
            dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_DL_CPU, 0)
        except (TypeError, ValueError, RuntimeError, BufferError) as e:   # e.g. torch's "meta" device
            raise TypeError(f"{name}: its device has no DLPack form, not the CPU ({e})") from None
        try:
            dev = (int(dev[0]), int(dev[1]))
        except (TypeError, ValueError, IndexError):
            raise TypeError(f"{name}: __dlpack_device__() returned {dev!r}, not (device type, id)") from None
        if dev[0] != _DL_CPU:
            raise TypeError(f"{name} is on DLPack device {dev}, not the CPU: kvcache reads and writes host "
                            f"memory only (for K/V on a device, build the cache with buffers=None and "
                            f"apply its plans there)")
        try:
            return np.from_dlpack(obj)
        except (BufferError, TypeError, ValueError, RuntimeError):
            pass
        # dtypes numpy does not import (bfloat16): read the capsule directly
        try:
            return _from_dlpack_capsule(obj, name)
        except BufferError as e:     # the producer refused (e.g. a tensor that requires grad)
            raise BufferError(f"{name}: {e}") from None
        except RuntimeError as e:    # the producer failed (e.g. a nested tensor)
            raise TypeError(f"{name}: its __dlpack__() failed ({e})") from None
    raise TypeError(f"{name} must support the buffer protocol or __dlpack__, not {type(obj).__name__}")


cdef class _HeldBuffer:
    """An array argument's memory, pinned from the moment it is taken until release(): the
    exporter's buffer (PyObject_GetBuffer) says where it is, how large it is and whether it is
    writable, and an exporter that can move or free its memory (bytearray, mmap, array.array)
    refuses to while it is held. The checks read the buffer, never attributes, so they stay
    true until the C call."""
    cdef Py_buffer view
    cdef bint held
    cdef readonly object dtype      # element dtype (of the ndarray the memory was described as)
    cdef readonly object array      # that ndarray (exactly np.ndarray), for numpy-level work
    cdef object pin                 # keep_owner's weak reference, while held

    def __dealloc__(self):
        self.release()

    cdef void release(self) noexcept:
        if self.held:
            self.held = False
            PyBuffer_Release(&self.view)
        self.pin = None

    cdef int keep_owner(self) except -1:
        """For memory held beyond the call (borrowed K/V, a checkpoint pool): the ndarray that
        owns it refuses numpy's ``resize(refcheck=False)``, which would free it under the cache.
        An exported buffer does not stop that resize; a weak reference to the array does (numpy
        resizes no array that is weakly referenced or is a view). Memory no ndarray owns (a
        bytearray, an mmap, a tensor's) is pinned by its exporter already."""
        owner = _memory_owner(self.array)
        if owner is not None:
            self.pin = _weakref(owner)
        return 0

    cdef inline bint c_contiguous(self) noexcept:
        return PyBuffer_IsContiguous(&self.view, b'C') != 0

    cdef inline Py_ssize_t dim(self, int i) noexcept:
        return self.view.shape[i]

    cdef tuple shape(self):
        return tuple(self.view.shape[i] for i in range(self.view.ndim))

    cdef str describe(self):
        return f"{self.dtype} {self.shape()}"


_nd_base = np.ndarray.base.__get__   # the C field: a subclass's own `base` is never consulted


cdef object _memory_owner(object arr):
    """The ndarray at the root of arr's chain of views, which owns the memory and could free it,
    or None when the memory is not an ndarray's own (the root's base is another object)."""
    cdef object a = arr
    cdef object b = _nd_base(a)
    while b is not None:
        if not isinstance(b, np.ndarray):
            return None
        a = b
        b = _nd_base(a)
    return a


cdef _HeldBuffer hold_buffer(object obj, object name, bint writable):
    """Take the memory of an array argument (see host_array) and pin it; ValueError when it
    must be writable and is not. name: see _text (an exact ndarray never needs it)."""
    arr = obj if type(obj) is np.ndarray else host_array(obj, _text(name))
    cdef _HeldBuffer hb = _HeldBuffer.__new__(_HeldBuffer)
    # no format requested: numpy exports every dtype (bfloat16 too) this way; the dtype is the
    # array's own
    PyObject_GetBuffer(arr, &hb.view, PyBUF_STRIDES)
    hb.held = True
    hb.dtype = arr.dtype
    hb.array = arr
    if writable and hb.view.readonly:
        hb.release()
        raise ValueError(f"{_text(name)} is read-only")
    return hb


cdef bint _rows_ok(_HeldBuffer hb) noexcept:
    """A 1-D or 2-D output buffer C can fill row by row: the elements of a row contiguous, the
    rows (2-D) ascending and not overlapping; the row stride is the buffer's own."""
    cdef int nd = hb.view.ndim
    cdef Py_ssize_t el = hb.view.itemsize
    if hb.view.strides == NULL:
        return True
    if hb.view.shape[nd - 1] > 1 and hb.view.strides[nd - 1] != el:
        return False
    return nd != 2 or hb.view.shape[0] <= 1 or hb.view.strides[0] >= hb.view.shape[1] * el


cdef object _block(object out, _HeldBuffer hb, Py_ssize_t rows, Py_ssize_t cols):
    """What a call that filled the leading [rows, cols] (2-D) or [rows] (1-D) block of a
    caller's buffer returns: out itself when that is all of it, else the block as a view of
    out's own kind (numpy for a plain buffer-protocol object)."""
    cdef tuple shape = (rows,)
    if hb.view.ndim == 2:
        shape = (rows, cols)
    if tuple(hb.view.shape[i] for i in range(hb.view.ndim)) == shape:
        return out
    idx = tuple(slice(0, n) for n in shape)
    if isinstance(out, np.ndarray) or hasattr(out, "__dlpack__"):
        return out[idx]
    return hb.array[idx]


cdef _HeldBuffer _borrowed_held(object obj, size_t need, int32_t type_id, object name, object layout):
    """Validate a borrowed K or V buffer and return the _HeldBuffer that pins it for the cache's
    lifetime (the layer's bytes are its first `need`). name, layout: see _text.

    It must be host memory, C-contiguous, writable, aligned, hold at least `need` bytes and
    have the type's element dtype (float32 / float16 / bfloat16 or uint16) or be raw uint8."""
    cdef _HeldBuffer hb = hold_buffer(obj, name, False)
    el = _element_dtype(type_id)
    dt = hb.dtype
    # numpy's builtin dtypes are singletons: the usual case is settled without comparing
    if not (dt is el or dt is _U8 or (type_id == KVC_TYPE_BF16 and dt is _U16)):
        ok = [el, _U8] + ([_U16] if type_id == KVC_TYPE_BF16 else [])
        if dt not in ok:
            names = " or ".join(dict.fromkeys(str(d) for d in ok))
            tname = kvc_type_get(type_id).name.decode()
            raise TypeError(f"{_text(name)} has dtype {_dtype_name(dt)}, which cannot hold {tname} data ({names})")
    if not hb.c_contiguous():
        raise ValueError(f"{_text(name)} must be C-contiguous")
    if hb.view.readonly:
        raise ValueError(f"{_text(name)} is read-only")
    if hb.view.itemsize > 1 and (<uintptr_t>hb.view.buf) % <uintptr_t>hb.view.itemsize:
        raise ValueError(f"{_text(name)} is not aligned to its {hb.view.itemsize}-byte elements")
    if <size_t>hb.view.len < need:
        raise ValueError(f"{_text(name)} holds {hb.view.len} bytes; the layer needs {need} ({_text(layout)})")
    hb.keep_owner()
    return hb


cdef object _held_bytes(_HeldBuffer hb, size_t need):
    """The first `need` bytes of a held buffer, as a uint8 ndarray over its memory."""
    return np.ndarray.view(hb.array.reshape(-1), dtype=np.uint8, type=np.ndarray)[:need]


cdef object _borrowed_bytes(object obj, size_t need, int32_t type_id, object name, object layout):
    """_borrowed_held, and the buffer's first `need` bytes as a uint8 view: (view, held buffer)."""
    cdef _HeldBuffer hb = _borrowed_held(obj, need, type_id, name, layout)
    return _held_bytes(hb, need), hb


cdef int _check_disjoint(list regions) except -1:
    """regions: (name, start address, byte count) of borrowed memory (name: see _text); no two
    may overlap."""
    spans = []
    for nm, start, n in regions:
        if n:
            spans.append((start, start + n, nm))
    spans.sort(key=_span_start)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{_text(n0)} and {_text(n1)} overlap in memory")
    return 0



cdef list _layer_regions(const kvc_layer *layers, uint32_t n_layer, size_t rows, str part):
    """_check_disjoint's regions of the K and V memory of layers[0, n_layer), rows rows each (a
    cache's layers; part names the cache in a message)."""
    cdef uint32_t i
    out = []
    for i in range(n_layer):
        if layers[i].k != NULL:
            out.append((("{}layer {} K", part, layers[i].il), <size_t>layers[i].k, rows * layers[i].k_row_bytes))
        if layers[i].v != NULL:
            out.append((("{}layer {} V", part, layers[i].il), <size_t>layers[i].v, rows * layers[i].v_row_bytes))
    return out

def _span_start(span):
    return span[0]


# --- DLPack export of bf16 views (numpy exports the other dtypes itself) ----------------------

cdef void _dl_export_deleter(_DLManagedTensor *m) noexcept with gil:
    Py_DECREF(<object>m.manager_ctx)
    free(m)


cdef void _dl_capsule_destructor(object cap) noexcept:
    cdef _DLManagedTensor *m
    if PyCapsule_IsValid(cap, "dltensor"):   # never consumed: release it ourselves
        m = <_DLManagedTensor *>PyCapsule_GetPointer(cap, "dltensor")
        m.deleter(m)


cdef object _dlpack_export(object arr, uint8_t code, uint8_t bits):
    """A legacy DLPack capsule over arr's memory (kept alive until the consumer deletes it)."""
    cdef int ndim = arr.ndim, i
    cdef Py_ssize_t item = arr.itemsize
    cdef _DLManagedTensor *m = <_DLManagedTensor *>malloc(sizeof(_DLManagedTensor)
                                                           + 2 * (ndim if ndim else 1) * sizeof(int64_t))
    if m == NULL:
        raise MemoryError("__dlpack__")
    cdef int64_t *dims = <int64_t *>(m + 1)
    for i in range(ndim):
        dims[i] = arr.shape[i]
        dims[ndim + i] = arr.strides[i] // item
    m.dl_tensor.data = <void *><size_t>arr.ctypes.data
    m.dl_tensor.device.device_type = _DL_CPU
    m.dl_tensor.device.device_id = 0
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype.code = code
    m.dl_tensor.dtype.bits = bits
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.shape = dims
    m.dl_tensor.strides = dims + ndim
    m.dl_tensor.byte_offset = 0
    Py_INCREF(arr)
    m.manager_ctx = <void *>arr
    m.deleter = _dl_export_deleter
    try:
        return PyCapsule_New(m, "dltensor", _dl_capsule_destructor)
    except BaseException:
        _dl_export_deleter(m)
        raise


class BFloat16View(np.ndarray):
    """A numpy array of ``ml_dtypes.bfloat16`` that also exports itself through DLPack (as
    bfloat16), so ``torch.from_dlpack(cache.k(il))`` works without a copy for bf16 caches."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("BFloat16View exports its own memory only (copy=True)")
        if dl_device is not None and tuple(dl_device)[0] != _DL_CPU:
            raise BufferError(f"BFloat16View lives on the CPU, not on {tuple(dl_device)}")
        if any(s % self.itemsize for s in self.strides):
            raise BufferError("strides are not a whole number of elements")
        return _dlpack_export(self, _DL_BFLOAT, 16)

    def __dlpack_device__(self):
        return (_DL_CPU, 0)


cdef object _typed_view(object mem, object dt, tuple shape):
    """mem (uint8) as dtype dt in shape; bf16 views can be exported through DLPack."""
    v = mem.view(dt).reshape(shape)
    if _BF16 is not None and dt is _BF16:
        v = v.view(BFloat16View)
    return v
