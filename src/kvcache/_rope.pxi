# RoPE K-shift and row (de)quantization: RopeParams, rope_shift, quantize, dequantize.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from kvcache.includes.kvc_quant cimport kvc_quantize_row, kvc_dequantize_row
from kvcache.includes.kvc_rope cimport *

_ROPE_MODES = {"normal": 0, "neox": 2}


cdef const kvc_type_info *_rope_type(object t, str argname) except NULL:
    """The type table entry of a type given by name ("q8_0") or ggml id (8)."""
    cdef const kvc_type_info *info = NULL
    if isinstance(t, str):
        info = kvc_type_by_name(t.encode("ascii", "replace"))
    elif isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        if -2147483648 <= t <= 2147483647:
            info = kvc_type_get(<int32_t>t)
    else:
        raise TypeError(f"{argname} must be a type name or ggml type id, not {type(t).__name__}")
    if info == NULL:
        names = [kvc_type_at(i).name.decode() for i in range(kvc_type_count())]
        raise ValueError(f"{argname} = {t!r} is not a supported type (one of {', '.join(names)})")
    return info


cdef dict _rope_layer_map(object v, str argname):
    """Per-layer overrides as {layer: float}; a list gives one entry per layer (None = no override)."""
    if v is None:
        return None
    out = {}
    if isinstance(v, dict):
        items = v.items()
    else:
        try:
            items = list(enumerate(v))
        except TypeError:
            raise TypeError(f"{argname} must be a dict {{layer: value}} or a list, not {type(v).__name__}") from None
    for il, x in items:
        if not isinstance(il, (int, np.integer)) or isinstance(il, bool) or il < 0:
            raise ValueError(f"{argname}: layer {il!r} is not a non-negative int")
        if x is None:
            continue
        x = float(x)
        if not x > 0.0:
            raise ValueError(f"{argname}[{il}] = {x} must be > 0")
        out[int(il)] = x
    return out


cdef class RopeParams:
    """The parameters of a RoPE K-shift, as ggml's extended RoPE takes them.

    ``RopeParams(n_rot, mode=0, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0,
    ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0, freq_factors=None,
    layer_freq_base=None, layer_freq_scale=None)``

    - ``n_rot``: rotated dimensions per head (even, at most the head size).
    - ``mode``: 0 / ``"normal"`` (pairs ``(2i, 2i+1)``) or 2 / ``"neox"`` (pairs ``(i, i+n_rot/2)``).
    - ``n_ctx_orig``, ``beta_fast``, ``beta_slow``: the YaRN correction range.
    - ``freq_base``, ``freq_scale``: frequency base and position scale.
    - ``ext_factor``: YaRN extrapolation mix (0 = plain RoPE); ``attn_factor``: magnitude of cos/sin.
    - ``freq_factors``: optional ``n_rot/2`` divisors of the per-pair angle.
    - ``layer_freq_base``, ``layer_freq_scale``: optional per-model-layer overrides of
      ``freq_base`` / ``freq_scale``, as a dict ``{layer: value}`` or a list indexed by layer
      (``None`` entries keep the default).
    """

    def __cinit__(self, n_rot, mode=0, n_ctx_orig=0, freq_base=10000.0, freq_scale=1.0,
                  ext_factor=0.0, attn_factor=1.0, beta_fast=32.0, beta_slow=1.0,
                  freq_factors=None, layer_freq_base=None, layer_freq_scale=None):
        if not isinstance(n_rot, (int, np.integer)) or isinstance(n_rot, bool):
            raise TypeError(f"n_rot must be an int, not {type(n_rot).__name__}")
        if n_rot < 0 or n_rot % 2 or n_rot > 1 << 20:
            raise ValueError(f"n_rot = {n_rot} must be a non-negative even number")
        if isinstance(mode, str):
            if mode not in _ROPE_MODES:
                raise ValueError(f"mode = {mode!r} must be 'normal' or 'neox'")
            mode = _ROPE_MODES[mode]
        if mode not in (0, 2) or isinstance(mode, bool):
            raise ValueError(f"mode = {mode!r} must be 0 (normal) or 2 (neox)")
        if not isinstance(n_ctx_orig, (int, np.integer)) or isinstance(n_ctx_orig, bool):
            raise TypeError(f"n_ctx_orig must be an int, not {type(n_ctx_orig).__name__}")
        if n_ctx_orig < 0 or n_ctx_orig > 2147483647:
            raise ValueError(f"n_ctx_orig = {n_ctx_orig} must lie in [0, 2**31)")
        vals = {}
        for name, v in (("freq_base", freq_base), ("freq_scale", freq_scale), ("ext_factor", ext_factor),
                        ("attn_factor", attn_factor), ("beta_fast", beta_fast), ("beta_slow", beta_slow)):
            try:
                vals[name] = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"{name} must be a number, not {type(v).__name__}") from None
        if not vals["freq_base"] > 0.0:
            raise ValueError(f"freq_base = {freq_base} must be > 0")
        if not vals["freq_scale"] > 0.0:
            raise ValueError(f"freq_scale = {freq_scale} must be > 0")
        kvc_rope_params_init(&self.c, <int32_t>n_rot)
        self.c.mode = <int32_t>mode
        self.c.n_ctx_orig = <int32_t>n_ctx_orig
        self.c.freq_base = vals["freq_base"]
        self.c.freq_scale = vals["freq_scale"]
        self.c.ext_factor = vals["ext_factor"]
        self.c.attn_factor = vals["attn_factor"]
        self.c.beta_fast = vals["beta_fast"]
        self.c.beta_slow = vals["beta_slow"]
        self._factors = None
        if freq_factors is not None:
            ff = np.array(freq_factors, dtype=np.float32, copy=True).reshape(-1)
            if ff.shape[0] != n_rot // 2:
                raise ValueError(f"freq_factors has {ff.shape[0]} values, expected n_rot/2 = {n_rot // 2}")
            ff.flags.writeable = False
            self._factors = ff
        self._layer_base = _rope_layer_map(layer_freq_base, "layer_freq_base")
        self._layer_scale = _rope_layer_map(layer_freq_scale, "layer_freq_scale")

    cdef int fill(self, kvc_rope_params *out, object layer, uint32_t head_dim) except -1:
        """The C parameters for a model layer (None: no per-layer override), checked
        against heads of head_dim elements."""
        cdef const float[::1] ff
        out[0] = self.c
        if self._factors is not None and self._factors.shape[0] > 0:
            ff = self._factors
            out.freq_factors = &ff[0]
        if layer is not None:
            if self._layer_base is not None and layer in self._layer_base:
                out.freq_base = self._layer_base[layer]
            if self._layer_scale is not None and layer in self._layer_scale:
                out.freq_scale = self._layer_scale[layer]
        if <uint32_t>self.c.n_rot > head_dim:
            raise ValueError(f"n_rot = {self.c.n_rot} exceeds head_dim = {head_dim}")
        return 0

    def freq_base_for(self, layer=None):
        """freq_base of a model layer (its override, or the default)."""
        if layer is not None and self._layer_base is not None and layer in self._layer_base:
            return self._layer_base[layer]
        return self.c.freq_base

    def freq_scale_for(self, layer=None):
        """freq_scale of a model layer (its override, or the default)."""
        if layer is not None and self._layer_scale is not None and layer in self._layer_scale:
            return self._layer_scale[layer]
        return self.c.freq_scale

    def angles(self, int32_t pos, layer=None):
        """(cos, sin) arrays of the n_rot/2 pairs for position delta ``pos``, magnitude included."""
        cdef kvc_rope_params p
        self.fill(&p, layer, <uint32_t>self.c.n_rot)
        cs = np.empty(max(self.c.n_rot, 1), dtype=np.float32)
        cdef float[::1] v = cs
        kvc_rope_angles(&p, pos, &v[0])
        return cs[0:self.c.n_rot:2].copy(), cs[1:self.c.n_rot:2].copy()

    def corr_dims(self, layer=None):
        """The YaRN ramp range (first, last pair index) as ggml computes it."""
        cdef float d[2]
        kvc_rope_corr_dims(self.c.n_rot, self.c.n_ctx_orig, <float>self.freq_base_for(layer),
                           self.c.beta_fast, self.c.beta_slow, d)
        return (d[0], d[1])

    @property
    def n_rot(self): return self.c.n_rot
    @property
    def mode(self): return self.c.mode
    @property
    def n_ctx_orig(self): return self.c.n_ctx_orig
    @property
    def freq_base(self): return self.c.freq_base
    @property
    def freq_scale(self): return self.c.freq_scale
    @property
    def ext_factor(self): return self.c.ext_factor
    @property
    def attn_factor(self): return self.c.attn_factor
    @property
    def beta_fast(self): return self.c.beta_fast
    @property
    def beta_slow(self): return self.c.beta_slow
    @property
    def freq_factors(self):
        """The per-pair divisors (read-only float32 array) or None."""
        return self._factors
    @property
    def layer_freq_base(self):
        return dict(self._layer_base) if self._layer_base is not None else None
    @property
    def layer_freq_scale(self):
        return dict(self._layer_scale) if self._layer_scale is not None else None

    def __repr__(self):
        s = (f"RopeParams(n_rot={self.c.n_rot}, mode={self.c.mode}, n_ctx_orig={self.c.n_ctx_orig}, "
             f"freq_base={self.c.freq_base!r}, freq_scale={self.c.freq_scale!r}, "
             f"ext_factor={self.c.ext_factor!r}, attn_factor={self.c.attn_factor!r}, "
             f"beta_fast={self.c.beta_fast!r}, beta_slow={self.c.beta_slow!r}")
        if self._factors is not None:
            s += f", freq_factors={self._factors.tolist()!r}"
        if self._layer_base:
            s += f", layer_freq_base={self._layer_base!r}"
        if self._layer_scale:
            s += f", layer_freq_scale={self._layer_scale!r}"
        return s + ")"


_ROPE_DTYPES = {
    # dtype kind/size of a K array -> the storage types whose bytes it may hold
    np.dtype(np.float32): ("f32",),
    np.dtype(np.float16): ("f16",),
    np.dtype(np.uint16): ("f16", "bf16"),
}
if _BF16 is not None:
    _ROPE_DTYPES[_BF16] = ("bf16",)


def rope_shift(k, type_k, n_head, head_dim, shift, RopeParams params not None, layer=None):
    """Apply a RoPE K-shift in place: rotate row r of ``k`` by the position delta ``shift[r]``.

    - ``k``: writable numpy array whose first axis is the rows (cells); each row holds
      ``n_head`` heads of ``head_dim`` elements in ``type_k`` storage, contiguous within the
      row (rows may be strided). Its dtype is float32 (f32), float16 (f16), uint16 (f16 / bf16)
      or uint8 / int8 (the raw bytes, any type).
    - ``type_k``: storage type name (``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``,
      ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"iq4_nl"``) or ggml type id.
    - ``shift``: one int32 delta per row.
    - ``params``: a :class:`RopeParams`; ``layer`` selects its per-layer overrides.

    Quantized rows are decoded, rotated and re-encoded (every block, also rows with
    shift 0), as llama.cpp's K-shift does. Arguments are all checked before any byte
    changes."""
    cdef const kvc_type_info *info = _rope_type(type_k, "type_k")
    cdef kvc_rope_params p
    cdef Py_ssize_t n_rows, i, row_bytes, expect
    cdef uint32_t nh, hd
    cdef int rc
    if not isinstance(k, np.ndarray):
        raise TypeError(f"k must be a numpy array, not {type(k).__name__}")
    for name, v in (("n_head", n_head), ("head_dim", head_dim)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        if v <= 0 or v > 1 << 24:
            raise ValueError(f"{name} = {v} must be positive")
    nh = <uint32_t>n_head
    hd = <uint32_t>head_dim
    if hd % info.blck_size:
        raise ValueError(f"head_dim = {hd} is not a multiple of the {info.name.decode()} block size {info.blck_size}")
    params.fill(&p, layer, hd)
    if k.ndim < 2:
        raise ValueError(f"k must have a row axis and a row content axis (ndim >= 2), got shape {k.shape}")
    allowed = _ROPE_DTYPES.get(k.dtype)
    tname = info.name.decode()
    if allowed is None and k.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise TypeError(f"k has dtype {k.dtype}; expected float32, float16, uint16 or uint8")
    if allowed is not None and tname not in allowed:
        raise TypeError(f"k has dtype {k.dtype}, which cannot hold {tname} data (use a uint8 view)")
    if not k.flags.writeable:
        raise ValueError("k is read-only")
    n_rows = k.shape[0]
    # the content of a row must be C-contiguous
    expect = k.itemsize
    for i in range(k.ndim - 1, 0, -1):
        if k.shape[i] > 1 and k.strides[i] != expect:
            raise ValueError("k must be contiguous within each row (rows may be strided)")
        expect *= k.shape[i]
    row_bytes = expect
    need = kvc_row_size(info.id, <uint64_t>nh * hd)
    if row_bytes < <Py_ssize_t>need:
        raise ValueError(f"a row of k holds {row_bytes} bytes; n_head * head_dim = {nh * hd} {tname} "
                         f"elements need {need}")
    sh = np.asarray(shift)
    if sh.ndim != 1 or sh.shape[0] != n_rows:
        raise ValueError(f"shift must hold one value per row of k ({n_rows}), got shape {sh.shape}")
    if sh.size and not np.issubdtype(sh.dtype, np.integer):
        raise TypeError(f"shift must hold integers, got dtype {sh.dtype}")
    if sh.size and (sh.min() < -2147483648 or sh.max() > 2147483647):
        raise ValueError("shift values must fit in int32")
    sh = np.ascontiguousarray(sh, dtype=np.int32)
    if n_rows == 0:
        return
    if n_rows > 0xFFFFFFFF:
        raise ValueError(f"k has too many rows ({n_rows})")
    if n_rows > 1 and k.strides[0] < row_bytes:
        raise ValueError(f"rows of k overlap (row stride {k.strides[0]} < row size {row_bytes})")
    cdef const int32_t[::1] shv = sh
    cdef uint8_t *base = <uint8_t *><size_t>k.__array_interface__["data"][0]
    cdef size_t stride = <size_t>k.strides[0] if n_rows > 1 else <size_t>row_bytes
    cdef uint32_t nr = <uint32_t>n_rows
    cdef int32_t tid = info.id
    with nogil:
        rc = kvc_rope_shift_rows(tid, base, nr, nh, hd, stride, &shv[0], &p, NULL)
    check_status(rc, NULL, "rope_shift")


cdef object _rope_bytes(object raw, str argname):
    """raw as a C-contiguous uint8 array (bytes-like objects are 1-D)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=np.uint8)
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{argname} must be a numpy array or bytes-like, not {type(raw).__name__}")
    arr = np.ascontiguousarray(raw)
    if arr.ndim == 0:
        raise ValueError(f"{argname} must have at least one dimension")
    return arr.view(np.uint8)


def quantize(x, type):
    """Encode float rows into ``type`` storage: ``x`` of shape (..., n) -> uint8 (..., row bytes).

    ``n`` must be a multiple of the type's block size (32 for quantized types). The
    quantized encoders are ggml's reference quantizers, byte for byte."""
    cdef const kvc_type_info *info = _rope_type(type, "type")
    arr = np.ascontiguousarray(x, dtype=np.float32)
    if arr.ndim == 0:
        raise ValueError("x must have at least one dimension")
    cdef Py_ssize_t n = arr.shape[arr.ndim - 1]
    if n % info.blck_size:
        raise ValueError(f"rows of x have {n} elements, not a multiple of the "
                         f"{info.name.decode()} block size {info.blck_size}")
    cdef size_t rb = kvc_row_size(info.id, <uint64_t>n) if n else 0
    out = np.empty(arr.shape[:arr.ndim - 1] + (rb,), dtype=np.uint8)
    cdef int64_t total = arr.size
    if total == 0:
        return out
    cdef const float[::1] src = arr.reshape(-1)
    cdef uint8_t[::1] dst = out.reshape(-1)
    cdef int32_t tid = info.id
    cdef int rc
    # blocks never straddle rows, so all rows encode as one long row
    with nogil:
        rc = kvc_quantize_row(tid, &src[0], &dst[0], total)
    check_status(rc, NULL, "quantize")
    return out


def dequantize(raw, type, n):
    """Decode rows of ``type`` storage: ``raw`` (..., row bytes of n elements) -> float32 (..., n).

    ``raw`` is a uint8 array (any other dtype is taken as its bytes) or a bytes-like object
    holding one row."""
    cdef const kvc_type_info *info = _rope_type(type, "type")
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"n must be an int, not {n.__class__.__name__}")
    if n < 0 or n % info.blck_size:
        raise ValueError(f"n = {n} is not a non-negative multiple of the "
                         f"{info.name.decode()} block size {info.blck_size}")
    arr = _rope_bytes(raw, "raw")
    cdef size_t rb = kvc_row_size(info.id, <uint64_t>n) if n else 0
    if <size_t>arr.shape[arr.ndim - 1] != rb:
        raise ValueError(f"raw rows hold {arr.shape[arr.ndim - 1]} bytes; {n} {info.name.decode()} "
                         f"elements take {rb}")
    out = np.empty(arr.shape[:arr.ndim - 1] + (n,), dtype=np.float32)
    cdef int64_t total = out.size
    if total == 0:
        return out
    cdef const uint8_t[::1] src = arr.reshape(-1)
    cdef float[::1] dst = out.reshape(-1)
    cdef int32_t tid = info.id
    cdef int rc
    with nogil:
        rc = kvc_dequantize_row(tid, &src[0], &dst[0], total)
    check_status(rc, NULL, "dequantize")
    return out
