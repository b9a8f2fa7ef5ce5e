# RoPE K-shift and row (de)quantization: RopeParams, rope_shift, quantize, dequantize.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from kvcache.includes.kvc_quant cimport kvc_quantize_row, kvc_dequantize_row
from kvcache.includes.kvc_rope cimport *

_ROPE_MODES = {"normal": 0, "neox": 2}


cdef float _finite_f32(object v, str name, bint positive) except? -1.0:
    """A float parameter of the RoPE math: a number that stays finite in float32 (> 0 when
    positive). TypeError for non-numbers, ValueError for inf / nan / out of range."""
    if _is_bool(v) or isinstance(v, (str, bytes)):
        raise TypeError(f"{name} must be a number, not {type(v).__name__}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, not {type(v).__name__}") from None
    cdef float f = <float>x
    if not (f - f == 0.0):      # inf or nan, also after the rounding to float32
        raise ValueError(f"{name} = {v} must be finite (in float32)")
    if positive and not f > 0.0:
        raise ValueError(f"{name} = {v} must be > 0")
    return f


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
        try:
            layer = int_c(il, f"{argname}: layer", 0, LLONG_MAX)
        except TypeError:
            raise ValueError(f"{argname}: layer {il!r} is not a non-negative int") from None
        if x is None:
            continue
        out[layer] = <double>_finite_f32(x, f"{argname}[{layer}]", True)
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
    cdef kvc_rope_params c         # the C view; c.freq_factors points into _factors
    cdef object _factors           # float32[n_rot/2] (C-contiguous) or None
    cdef object _layer_base        # dict model layer -> freq_base override, or None
    cdef object _layer_scale       # dict model layer -> freq_scale override, or None

    __signature__ = _signatures.ClassSignature(_signatures.rope_params)

    def __cinit__(self, *args, **kwargs):
        (n_rot, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, freq_factors,
         layer_freq_base, layer_freq_scale) = _signatures.bind(_signatures.rope_params, type(self), args, kwargs)
        n_rot = int_c(n_rot, "n_rot", LLONG_MIN, LLONG_MAX)
        if n_rot < 0 or n_rot % 2 or n_rot > 1 << 20:
            raise ValueError(f"n_rot = {n_rot} must be a non-negative even number")
        if isinstance(mode, str):
            if mode not in _ROPE_MODES:
                raise ValueError(f"mode = {mode!r} must be 'normal' or 'neox'")
            mode = _ROPE_MODES[mode]
        if _is_bool(mode) or mode not in (0, 2):
            raise ValueError(f"mode = {mode!r} must be 0 (normal) or 2 (neox)")
        n_ctx_orig = int_c(n_ctx_orig, "n_ctx_orig", 0, INT32_MAX)
        # every value of the math finite (in float32, as C computes): the rotation of a key is
        # then finite too
        vals = {"freq_base": _finite_f32(freq_base, "freq_base", True),
                "freq_scale": _finite_f32(freq_scale, "freq_scale", True),
                "ext_factor": _finite_f32(ext_factor, "ext_factor", False),
                "attn_factor": _finite_f32(attn_factor, "attn_factor", False),
                "beta_fast": _finite_f32(beta_fast, "beta_fast", False),
                "beta_slow": _finite_f32(beta_slow, "beta_slow", False)}
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
            ff = values_c(freq_factors, "freq_factors", VALUES_FLOAT, True).reshape(-1).astype(np.float32)
            if ff.shape[0] != n_rot // 2:
                raise ValueError(f"freq_factors has {ff.shape[0]} values, expected n_rot/2 = {n_rot // 2}")
            # the angle of a pair is divided by its factor
            if ff.size and not (np.isfinite(ff).all() and (ff > 0).all()):
                j = int(np.flatnonzero(~(np.isfinite(ff) & (ff > 0)))[0])
                raise ValueError(f"freq_factors[{j}] holds {ff[j]}: expected a finite number > 0")
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

    def angles(self, pos, layer=None):
        """(cos, sin) arrays of the n_rot/2 pairs for position delta ``pos``, magnitude included."""
        cdef int32_t delta = <int32_t>int_c(pos, "pos", INT32_MIN, INT32_MAX)
        cdef kvc_rope_params p
        self.fill(&p, layer, <uint32_t>self.c.n_rot)
        cs = np.empty(max(self.c.n_rot, 1), dtype=np.float32)
        cdef float[::1] v = cs
        kvc_rope_angles(&p, delta, &v[0])
        return cs[0:self.c.n_rot:2].copy(), cs[1:self.c.n_rot:2].copy()

    def corr_dims(self, layer=None):
        """The YaRN ramp range (first, last pair index) as ggml computes it."""
        cdef float d[2]
        kvc_rope_corr_dims(self.c.n_rot, self.c.n_ctx_orig, <float>self.freq_base_for(layer),
                           self.c.beta_fast, self.c.beta_slow, d)
        return (d[0], d[1])

    @property
    def n_rot(self):
        """Rotated dimensions per head."""
        return self.c.n_rot

    @property
    def mode(self):
        """0 (normal: pairs (2i, 2i+1)) or 2 (neox: pairs (i, i + n_rot/2))."""
        return self.c.mode

    @property
    def n_ctx_orig(self):
        """The training context the YaRN correction range is computed for."""
        return self.c.n_ctx_orig

    @property
    def freq_base(self):
        """Frequency base (default for layers without an override)."""
        return self.c.freq_base

    @property
    def freq_scale(self):
        """Position scale (default for layers without an override)."""
        return self.c.freq_scale

    @property
    def ext_factor(self):
        """YaRN extrapolation mix (0: plain RoPE)."""
        return self.c.ext_factor

    @property
    def attn_factor(self):
        """Magnitude applied to cos and sin."""
        return self.c.attn_factor

    @property
    def beta_fast(self):
        """YaRN correction range: the fast boundary."""
        return self.c.beta_fast

    @property
    def beta_slow(self):
        """YaRN correction range: the slow boundary."""
        return self.c.beta_slow
    @property
    def freq_factors(self):
        """The per-pair divisors (read-only float32 array) or None."""
        return self._factors
    @property
    def layer_freq_base(self):
        """Per-model-layer freq_base overrides as {layer: value}, or None."""
        return dict(self._layer_base) if self._layer_base is not None else None
    @property
    def layer_freq_scale(self):
        """Per-model-layer freq_scale overrides as {layer: value}, or None."""
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


def rope_shift(k, type_k, n_head, head_dim, shift, params, layer=None):
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
    cdef const kvc_type_info *info = type_c(type_k, "type_k")
    cdef kvc_rope_params p
    cdef Py_ssize_t n_rows, i, row_bytes, expect
    cdef uint32_t nh, hd
    cdef int rc
    if not isinstance(params, RopeParams):
        raise TypeError(f"params must be a kvcache.RopeParams, not {type(params).__name__}")
    nh = <uint32_t>int_c(n_head, "n_head", 1, 1 << 24)
    hd = <uint32_t>int_c(head_dim, "head_dim", 1, 1 << 24)
    if hd % info.blck_size:
        raise ValueError(f"head_dim = {hd} is not a multiple of the {info.name.decode()} block size {info.blck_size}")
    (<RopeParams>params).fill(&p, layer, hd)
    sh = values_c(shift, "shift", VALUES_INT)
    if sh.size and (sh.min() < INT32_MIN or sh.max() > INT32_MAX):
        j = int(np.flatnonzero((sh < INT32_MIN) | (sh > INT32_MAX))[0])
        raise ValueError(f"shift[{j}] holds {int(sh[j])}, outside the int32 range")
    sh = sh.astype(np.int32)
    # k is taken (and pinned) last, after every other argument: its layout comes from its buffer
    cdef _HeldBuffer kb = hold_buffer(k, "k", True)
    try:
        if kb.view.ndim < 2:
            raise ValueError(f"k must have a row axis and a row content axis (ndim >= 2), got {kb.describe()}")
        allowed = ("bf16",) if _is_bf16_bits(kb.dtype) else _ROPE_DTYPES.get(kb.dtype)
        tname = info.name.decode()
        if allowed is None and kb.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
            raise TypeError(f"k has dtype {kb.dtype}; expected float32, float16, uint16 or uint8")
        if allowed is not None and tname not in allowed:
            raise TypeError(f"k has dtype {_dtype_name(kb.dtype)}, which cannot hold {tname} data (use a uint8 view)")
        n_rows = kb.view.shape[0]
        # the content of a row must be C-contiguous
        expect = kb.view.itemsize
        for i in range(kb.view.ndim - 1, 0, -1):
            if kb.view.shape[i] > 1 and kb.view.strides[i] != expect:
                raise ValueError("k must be contiguous within each row (rows may be strided)")
            expect *= kb.view.shape[i]
        row_bytes = expect
        need = kvc_row_size(info.id, <uint64_t>nh * hd)
        if row_bytes < <Py_ssize_t>need:
            raise ValueError(f"a row of k holds {row_bytes} bytes; n_head * head_dim = {nh * hd} {tname} "
                             f"elements need {need}")
        if sh.shape[0] != n_rows:
            raise ValueError(f"shift must hold one value per row of k ({n_rows}), got shape {sh.shape}")
        if n_rows == 0:
            return
        if n_rows > 0xFFFFFFFF:
            raise ValueError(f"k has too many rows ({n_rows})")
        if n_rows > 1 and kb.view.strides[0] < row_bytes:
            raise ValueError(f"rows of k overlap (row stride {kb.view.strides[0]} < row size {row_bytes})")
        _rope_shift_held(kb, info.id, <uint32_t>n_rows, nh, hd, row_bytes, sh, &p)
    finally:
        kb.release()


cdef int _rope_shift_held(_HeldBuffer kb, int32_t tid, uint32_t nr, uint32_t nh, uint32_t hd, Py_ssize_t row_bytes,
                          object sh, kvc_rope_params *p) except -1:
    cdef const int32_t[::1] shv = sh
    cdef uint8_t *base = <uint8_t *>kb.view.buf
    cdef size_t stride = <size_t>kb.view.strides[0] if nr > 1 else <size_t>row_bytes
    cdef int rc
    with nogil:
        rc = kvc_rope_shift_rows(tid, base, nr, nh, hd, stride, &shv[0], p, NULL)
    check_status(rc, NULL, "rope_shift")
    return 0


cdef object _rope_bytes(object raw, str argname):
    """raw as a C-contiguous uint8 array (bytes-like objects are 1-D), read from its buffer."""
    arr = np.ascontiguousarray(host_array(raw, argname))
    if arr.ndim == 0:
        raise ValueError(f"{argname} must have at least one dimension")
    return arr.view(np.uint8)


def quantize(x, type):
    """Encode float rows into ``type`` storage: ``x`` of shape (..., n) -> uint8 (..., row bytes).

    ``n`` must be a multiple of the type's block size (32 for quantized types). The
    quantized encoders are ggml's reference quantizers, byte for byte."""
    cdef const kvc_type_info *info = type_c(type, "type")
    if PyObject_CheckBuffer(x) or hasattr(x, "__dlpack__"):
        arr = np.ascontiguousarray(_decoded(host_array(x, "x")), dtype=np.float32)
    else:
        arr = np.ascontiguousarray(values_c(x, "x", VALUES_FLOAT, True), dtype=np.float32)
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
    cdef const kvc_type_info *info = type_c(type, "type")
    n = int_c(n, "n", -1, 1 << 40)
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
