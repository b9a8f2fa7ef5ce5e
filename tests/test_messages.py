"""The errors a user meets, word for word.

Every error reachable from the public API and from the command line is one line that names the
argument (API: its keyword) or the flag (command line) the user gave, what was expected and what
was found: no internal function names, no numbers read from garbage as if they were a header.
TABLE holds one row per bad call, the call and its exact message (a str, or a compiled regex
that must match the whole line); one parametrized test runs them. The constructors of the
public classes also show their real parameters to ``inspect.signature``."""
import inspect
import io
import re

import numpy as np
import pytest

import kvcache
from kvcache import plan, simulate, statefile
from kvcache import inspect as kinspect
from kvcache.cli import main

TYPES = "f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, bf16"
NOT_A_STATE = ("not a state file{size}: it starts with no state file's magic (session file 'ggsn', sequence file "
               "'ggsq', 2026 sequence blob 0xaf143cd8) and does not read as a whole-context or cache state")
TEXT = b"# not a state at all\n" * 40


def _cache(**kw):
    return kvcache.UnifiedCache(256, 1, 64, 64, **kw)


def _placed(**kw):
    c = _cache(**kw)
    assert c.find_slot(kvcache.UBatch([0], [0]))
    return c


def _three_tokens():
    c = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2)
    assert c.find_slot(kvcache.UBatch([0, 1, 2], [0, 0, 0]))
    c.commit()
    return c


def _sequence_file():
    f = io.BytesIO()
    statefile.write_sequence_file(f, _three_tokens(), 0, [1, 2, 3])
    return f.getvalue()


def _blob_2026():
    return _three_tokens().state_write(0, layout="2026")


def _store(cache, k_rows, v_rows=None):
    return lambda: cache.store(0, k_rows, v_rows)


def _iswa(**kw):
    return kvcache.ISWACache(256, 2, 64, 64, [1], 4, **kw)


def _recurrent():
    return kvcache.RecurrentCache(2, 1, 8, 8)


# what the first four bytes of TEXT say as a count, and the bytes after them
TEXT_COUNT, TEXT_REST = int.from_bytes(TEXT[:4], "little"), len(TEXT) - 4
TEXT_CELLS = (f"state truncated at byte 4 of {len(TEXT)}: the cell count (byte 0) says {TEXT_COUNT} cells, which "
              f"need at least {{need}} bytes, {TEXT_REST} remain")


# (id, the call, the message); "cli" calls are argv lists whose "{name}" parts name the files of
# the `files` fixture
TABLE = [
    # constructors: Python's own words, under the class's name
    ("unified-missing", lambda: kvcache.UnifiedCache(256, 2),
     "UnifiedCache() missing 2 required positional arguments: 'n_embd_k_gqa' and 'n_embd_v_gqa'"),
    ("unified-too-many", lambda: kvcache.UnifiedCache(256, 1, 64, 64, *([None] * 16)),
     "UnifiedCache() takes from 4 to 19 positional arguments but 20 were given"),
    ("unified-twice", lambda: kvcache.UnifiedCache(256, 1, 64, 64, kv_size=256),
     "UnifiedCache() got multiple values for argument 'kv_size'"),
    ("unified-unknown-keyword", lambda: _cache(n_ctx=256),
     "UnifiedCache() got an unexpected keyword argument 'n_ctx'"),
    ("recurrent-missing", lambda: kvcache.RecurrentCache(1),
     "RecurrentCache() missing 3 required positional arguments: 'n_layer', 'n_embd_k_gqa', and 'n_embd_v_gqa'"),
    ("iswa-missing", lambda: kvcache.ISWACache(256, 2),
     "ISWACache() missing 4 required positional arguments: 'n_embd_k_gqa', 'n_embd_v_gqa', 'swa_layers', and "
     "'n_swa'"),
    ("iswa-unknown-keyword", lambda: _iswa(window=4),
     "ISWACache() got an unexpected keyword argument 'window'"),
    ("ubatch-missing", lambda: kvcache.UBatch([0]), "UBatch() missing 1 required positional argument: 'seq_id'"),
    ("ubatch-unknown-keyword", lambda: kvcache.UBatch([0], [0], token=[1]),
     "UBatch() got an unexpected keyword argument 'token'"),
    ("ubatch-keyword-only", lambda: kvcache.UBatch([0], [0], 1, None, [5]),
     "UBatch() takes from 2 to 4 positional arguments but 5 were given"),
    ("ubatch-twice", lambda: kvcache.UBatch([0], [0], 1, n_seq_tokens=1),
     "UBatch() got multiple values for argument 'n_seq_tokens'"),
    ("ubatch-keyword-missing", lambda: kvcache.UBatch(pos=[0], tokens=[1]),
     "UBatch() missing 1 required positional argument: 'seq_id'"),
    ("cells-missing", lambda: kvcache.Cells(np.zeros(2, np.int32)),
     "Cells() missing 2 required positional arguments: 'shift' and 'seq_mask'"),
    ("cells-unknown-keyword", lambda: kvcache.Cells(None, None, None, mask=None),
     "Cells() got an unexpected keyword argument 'mask'"),
    ("update-plan-too-many", lambda: kvcache.UpdatePlan(None, False, None, False, False, 0),
     "UpdatePlan() takes from 0 to 5 positional arguments but 6 were given"),
    ("update-plan-unknown-keyword", lambda: kvcache.UpdatePlan(rotate=True),
     "UpdatePlan() got an unexpected keyword argument 'rotate'"),
    ("stream-update-missing", lambda: kvcache.StreamUpdate(0, False),
     "StreamUpdate() missing 3 required positional arguments: 'copies', 'has_shift', and 'shift'"),
    ("batch-missing", lambda: kvcache.Batch(), "Batch() missing 2 required positional arguments: 'pos' and 'seq_id'"),
    ("rope-missing", lambda: kvcache.RopeParams(), "RopeParams() missing 1 required positional argument: 'n_rot'"),
    # constructors: the values
    ("unified-type-k", lambda: _cache(type_k="q7"), f"type_k = 'q7': unknown type (the ggml types kvcache "
                                                    f"supports: {TYPES})"),
    ("unified-type-k-kind", lambda: _cache(type_k=1.5),
     "type_k must be a ggml type name such as 'f16' or a ggml type id, not float"),
    ("unified-block", lambda: kvcache.UnifiedCache(256, 1, 8, 8, type_k="q8_0"),
     "UnifiedCache: n_embd_k_gqa of layer 0 (8) must be a positive multiple of 32 for type_k q8_0"),
    ("unified-kv-size", lambda: kvcache.UnifiedCache(100, 1, 64, 64),
     "UnifiedCache: kv_size (100) must be a positive multiple of n_pad (32)"),
    ("unified-kv-size-kind", lambda: kvcache.UnifiedCache("256", 1, 64, 64), "kv_size must be an int, not str"),
    ("unified-swa-type", lambda: _cache(swa_type="sliding"),
     "swa_type = 'sliding': expected one of none, standard, chunked"),
    ("unified-v-trans", lambda: _cache(v_trans="yes"), "v_trans must be a bool, not str"),
    ("unified-semantics", lambda: _cache(semantics="2024"), "semantics = '2024': expected one of 2025, 2026"),
    ("iswa-swa-type", lambda: _iswa(swa_type="sliding"),
     "swa_type = 'sliding': expected one of 'standard', 'chunked'"),
    ("recurrent-kv-size", lambda: kvcache.RecurrentCache(4, 1, 8, 8, kv_size=2),
     "RecurrentCache: kv_size = 2 must lie in [n_seq_max = 4, 2**31)"),
    ("recurrent-row-width", lambda: kvcache.RecurrentCache(1, 1, 2**31 - 1, 8, n_embd_k_s=1),
     "n_embd_k_gqa + n_embd_k_s = 2147483647 + 1 = 2147483648 (layer 0): expected at most 2**31 - 1"),
    ("recurrent-row-width-layer", lambda: kvcache.RecurrentCache(1, 2, 8, 8, n_embd_v_s=[0, 2**31 - 8]),
     "n_embd_v_gqa + n_embd_v_s = 8 + 2147483640 = 2147483648 (layer 1): expected at most 2**31 - 1"),
    ("ubatch-seq-id", lambda: kvcache.UBatch([0, 1], [0]), "seq_id has 1 entries, expected one per token (2)"),
    ("ubatch-pos", lambda: kvcache.UBatch([0, -1], [0, 0]), "pos[1] holds -1, outside [0, 2147483648)"),
    ("batch-pos", lambda: kvcache.Batch([0, 1, 2**31], [0, 0, 0]),
     "pos[2] holds 2147483648, outside [0, 2147483648)"),
    ("rope-freq-factors", lambda: kvcache.RopeParams(4, freq_factors=[1.0, 0.0]),
     "freq_factors[1] holds 0.0: expected a finite number > 0"),
    ("rope-shift-values", lambda: kvcache.rope_shift(np.zeros((1, 8), np.float32), "f32", 1, 8, [2**40],
                                                      kvcache.RopeParams(4)),
     "shift[0] holds 1099511627776, outside the int32 range"),
    ("ubatch-n-seq-tokens", lambda: kvcache.UBatch([0], [0], n_seq_tokens=0),
     "n_seq_tokens = 0 is outside [1, 4294967295]"),
    ("rope-n-rot", lambda: kvcache.RopeParams(3), "n_rot = 3 must be a non-negative even number"),
    ("rope-mode", lambda: kvcache.RopeParams(4, mode="yarn"), "mode = 'yarn' must be 'normal' or 'neox'"),
    # methods
    ("find-slot-not-a-ubatch", lambda: _cache().find_slot([0]), "ub must be a kvcache.UBatch, not list"),
    ("kq-mask-not-a-ubatch", lambda: _cache().kq_mask(None), "ub must be a kvcache.UBatch, not NoneType"),
    ("kq-mask-causal", lambda: _cache().kq_mask(kvcache.UBatch([0], [0]), causal="no"),
     "causal must be a bool, not str"),
    ("kq-mask-pad", lambda: _cache().kq_mask(kvcache.UBatch([0], [0]), pad=0), "pad must be a bool, not int"),
    ("kq-mask-reuse", lambda: _cache().kq_mask(kvcache.UBatch([0], [0]), reuse=None),
     "reuse must be a bool, not NoneType"),
    ("iswa-kq-mask-alibi", lambda: _iswa().kq_mask(kvcache.UBatch([0], [0]), alibi=1), "alibi must be a bool, not int"),
    ("state-read-exact", lambda: _cache().state_read(b"", exact="yes"), "exact must be a bool, not str"),
    ("iswa-state-read-convert", lambda: _iswa().state_read(b"", convert=1), "convert must be a bool, not int"),
    ("recurrent-state-read-exact", lambda: _recurrent().state_read(b"", exact=1), "exact must be a bool, not int"),
    ("iswa-find-slot-not-a-ubatch", lambda: _iswa().find_slot((0, 0)), "ub must be a kvcache.UBatch, not tuple"),
    ("recurrent-find-slot-not-a-ubatch", lambda: kvcache.RecurrentCache(1, 1, 8, 8).find_slot(0),
     "ub must be a kvcache.UBatch, not int"),
    ("rope-shift-params", lambda: kvcache.rope_shift(np.zeros((1, 8), np.float32), "f32", 1, 8, [1], None),
     "params must be a kvcache.RopeParams, not NoneType"),
    ("rope-angles-pos", lambda: kvcache.RopeParams(4).angles("3"), "pos must be an int, not str"),
    ("store-f32-into-f16", _store(_placed(), np.zeros((1, 32), np.float32)),
     "k_rows must have shape (1, 64), not (1, 32)"),
    ("store-f32", _store(_placed(type_k="f32", type_v="f32"), np.zeros((2, 64), np.float32)),
     "k_rows must have shape (1, 64), not (2, 64)"),
    ("store-v-rows", _store(_placed(type_k="f32", type_v="f32"), None, np.zeros((64,), np.float32)),
     "v_rows must have shape (1, 64), not (64,)"),
    ("seq-rm-id", lambda: _cache().seq_rm(5, 0, 1), "seq_id = 5 is outside [-1, 1)"),
    ("k-layer", lambda: _cache().k(3), "il = 3 is not a layer of this cache (layers: [0])"),
    ("ubatches-n-ubatch", lambda: list(kvcache.Batch([0], [0]).ubatches(0)),
     "n_ubatch = 0 is outside [1, 9223372036854775807]"),
    # kvcache.plan and kvcache.simulate
    ("plan-type-k", lambda: plan.plan_unified(4096, n_layer=2, n_embd_k_gqa=64, type_k="q7"),
     f"type_k = 'q7': unknown type (the ggml types kvcache supports: {TYPES})"),
    ("plan-block", lambda: plan.plan_unified(4096, n_layer=2, n_embd_k_gqa=60, type_k="q8_0", flash_attn=True),
     "n_embd_k_gqa = 60 (layer 0): expected a multiple of 32, the block size of type_k = q8_0"),
    ("plan-v-trans", lambda: plan.plan_unified(4096, n_layer=2, n_embd_k_gqa=64, type_v="q8_0"),
     "type_v = q8_0: expected a type of one element per block without flash_attn (V is stored transposed), "
     "found a block type"),
    ("plan-recurrent-block", lambda: plan.plan_recurrent(n_layer=2, n_embd_k_gqa=0, n_embd_v_gqa=0, n_embd_k_s=60,
                                                         n_embd_v_s=64, type_k="q8_0"),
     "n_embd_k_gqa + n_embd_k_s = 60 (layer 0): expected a multiple of 32, the block size of type_k = q8_0"),
    ("simulate-block", lambda: simulate.SimConfig(type_k="q8_0").check(),
     "n_embd = 8: expected a multiple of 32, the block size of type_k = q8_0"),
    ("simulate-type", lambda: simulate.SimConfig(type_v="q7").check(),
     f"type_v = 'q7': unknown type (the ggml types kvcache supports: {TYPES})"),
    ("simulate-v-trans", lambda: simulate.SimConfig(type_v="q8_0", n_embd=32).check(),
     "type_v = q8_0: expected a type of one element per block without flash_attn (V is stored transposed), "
     "found a block type"),
    # a cache's state_read of bytes that are no state: no counts read from them
    ("state-read-text", lambda: _cache().state_read(TEXT),
     f"state_read: not a cache state ({len(TEXT)} bytes): it frames as one in no layout, with or without stream "
     "counts (damaged, truncated or other data; pass the layout to see where a read of it stops)"),
    ("state-read-ones", lambda: _cache(semantics="2026").state_read(b"\xff" * 64),
     "state_read: not a cache state (64 bytes): it frames as one in no layout, with or without stream counts "
     "(damaged, truncated or other data; pass the layout to see where a read of it stops)"),
    # ... and with the layout named, or into a recurrent cache: a count the bytes after it cannot
    # hold is named as what the bytes say, never compared with the cache
    ("state-read-text-layout", lambda: _cache().state_read(TEXT, layout="2025"),
     "state_read: " + TEXT_CELLS.format(need=8 * TEXT_COUNT)),
    ("state-read-text-seq", lambda: _cache().state_read(TEXT, 0, layout="2025"),
     "state_read: " + TEXT_CELLS.format(need=12 * TEXT_COUNT)),
    ("state-read-text-streams", lambda: _cache(semantics="2026").state_read(TEXT, layout="2026"),
     f"state_read: state truncated at byte 4 of {len(TEXT)}: the stream count (byte 0) says {TEXT_COUNT} streams, "
     f"which need at least {4 * TEXT_COUNT} bytes, {TEXT_REST} remain"),
    ("iswa-state-read-text-layout", lambda: _iswa().state_read(TEXT, layout="2025"),
     "state_read: part 0 of 2 (from byte 0): " + TEXT_CELLS.format(need=8 * TEXT_COUNT)),
    ("recurrent-state-read-text", lambda: _recurrent().state_read(TEXT),
     "state_read: " + TEXT_CELLS.format(need=8 * TEXT_COUNT)),
    ("recurrent-state-read-text-seq", lambda: _recurrent().state_read(TEXT, 1),
     "state_read: " + TEXT_CELLS.format(need=8 * TEXT_COUNT)),
    ("state-read-layer-count", lambda: _cache().state_read(bytes(4) + b"\x01\0\0\0" + b"\xff" * 4, layout="2025"),
     "state_read: state truncated at byte 12 of 12: the layer count (byte 8) says 4294967295 layers, which need at "
     "least 103079215080 bytes, 0 remain"),
    # a count the bytes can hold, of more cells than the cache has
    ("recurrent-state-read-cells", lambda: _recurrent().state_read(b"\x03\0\0\0" + bytes(100)),
     "state_read: not enough cells: the state holds 3 cells (byte 0), the cache has 2"),
    ("recurrent-state-read-seq-cells", lambda: _recurrent().state_read(b"\x02\0\0\0" + bytes(100), 0),
     "state_read: a sequence's state holds at most one cell in this cache, the state holds 2 (byte 0)"),
    # kvcache.inspect and kvcache.statefile
    ("inspect-text", lambda: kinspect.report_bytes(TEXT), NOT_A_STATE.format(size="")),
    ("inspect-empty", lambda: kinspect.report_bytes(b""), NOT_A_STATE.format(size="")),
    ("inspect-gguf", lambda: kinspect.report_bytes(b"GGUF" + bytes(40)),
     "this is a GGUF model, not a state file: use `kvcache plan` for the cache it needs"),
    ("inspect-variant", lambda: kinspect.report_bytes(b"", variant="mamba"),
     "variant must be one of unified, iswa, recurrent, hybrid, not 'mamba'"),
    ("inspect-truncated-blob", lambda: kinspect.report_bytes(_blob_2026()[:40]),
     re.compile(r"a 2026 sequence blob \(it starts with its prefix magic\) that does not read as one: cache state "
                r"framing: stream 0 \(from byte 12\): state truncated at byte \d+ of 28 while reading .*")),
    ("statefile-session-magic", lambda: statefile.parse_session_file(b"abcdefgh"),
     "session file: magic 0x64636261 is not a session file's 0x6767736e"),
    ("statefile-layout", lambda: statefile.parse(b"", layout="2027"),
     "unknown layout '2027': expected one of 2025, 2025-08, 2026-03, 2026-05, 2026-06, 2026"),
    ("statefile-data", lambda: statefile.parse(3), "data must be bytes-like, not int"),
    # the command line: flags, not keywords
    ("cli-simulate-block", ["simulate", "--type-k", "q8_0"],
     "kvcache simulate: error: --n-embd 8: expected a multiple of 32, the block size of --type-k q8_0"),
    ("cli-simulate-type", ["simulate", "--type-k", "q7"],
     f"kvcache simulate: error: --type-k 'q7': unknown type (the ggml types kvcache supports: {TYPES})"),
    ("cli-simulate-v-trans", ["simulate", "--type-v", "q8_0", "--n-embd", "32"],
     "kvcache simulate: error: --type-v q8_0: expected a type of one element per block without --flash-attn "
     "(V is stored transposed), found a block type"),
    ("cli-simulate-series", ["simulate", "--series"], "kvcache simulate: error: --series goes with --json"),
    ("cli-plan-type", ["plan", "--n-layer", "2", "--n-embd-k-gqa", "64", "--type-k", "q7"],
     f"kvcache plan: error: --type-k 'q7': unknown type (the ggml types kvcache supports: {TYPES})"),
    ("cli-plan-block", ["plan", "--n-layer", "2", "--n-embd-k-gqa", "60", "--type-k", "q8_0", "--flash-attn"],
     "kvcache plan: error: --n-embd-k-gqa 60 (layer 0): expected a multiple of 32, the block size of --type-k q8_0"),
    ("cli-plan-v-trans", ["plan", "--n-layer", "2", "--n-embd-k-gqa", "64", "--type-v", "q8_0"],
     "kvcache plan: error: --type-v q8_0: expected a type of one element per block without --flash-attn (V is "
     "stored transposed), found a block type"),
    ("cli-plan-recurrent", ["plan", "--recurrent", "--n-layer", "2", "--n-embd-k-s", "60", "--n-embd-v-s", "64",
                            "--type-k", "q8_0"],
     "kvcache plan: error: --n-embd-k-gqa + --n-embd-k-s 60 (layer 0): expected a multiple of 32, the block size "
     "of --type-k q8_0"),
    ("cli-plan-no-layers", ["plan"], "kvcache plan: error: --n-layer is required (or a GGUF model)"),
    ("cli-inspect-text", ["inspect", "{text}"],
     "kvcache inspect: error: {text}: " + NOT_A_STATE.format(size=f" ({len(TEXT)} bytes)")),
    ("cli-inspect-empty", ["inspect", "{empty}"],
     "kvcache inspect: error: {empty}: " + NOT_A_STATE.format(size=" (0 bytes)")),
    ("cli-inspect-truncated-sequence-file", ["inspect", "{ggsq}"],
     re.compile(r"kvcache inspect: error: {ggsq}: a truncated sequence file: it breaks off in the part that "
                r"starts at byte \d+ of {ggsq_size}")),
    ("cli-inspect-truncated-sequence-file-layout", ["inspect", "--layout", "2026", "{ggsq}"],
     re.compile(r"kvcache inspect: error: {ggsq}: a truncated sequence file: it breaks off in the part that "
                r"starts at byte \d+ of {ggsq_size}")),
    ("cli-inspect-sequence-file-head", ["inspect", "{ggsq_head}"],
     "kvcache inspect: error: {ggsq_head}: a truncated sequence file: it breaks off in the part that starts at "
     "byte 8 of 10"),
    ("cli-inspect-truncated-blob", ["inspect", "{blob}"],
     re.compile(r"kvcache inspect: error: {blob}: a truncated 2026 sequence blob: it breaks off in the part that "
                r"starts at byte \d+ of 40")),
    ("cli-inspect-newer-sequence-file", ["inspect", "{ggsq_newer}"],
     "kvcache inspect: error: {ggsq_newer}: a sequence file of version 9 (written by a newer llama.cpp?): kvcache "
     "reads versions 2 and 3"),
    ("cli-convert-newer-sequence-file", ["convert", "{ggsq_newer}", "{missing}", "--to", "2025"],
     "kvcache convert: error: {ggsq_newer}: a sequence file of version 9 (written by a newer llama.cpp?): kvcache "
     "reads versions 2 and 3"),
    ("cli-inspect-missing", ["inspect", "{missing}"],
     "kvcache inspect: error: {missing}: No such file or directory"),
    # convert says of an input that is no state what inspect says
    ("cli-convert-text", ["convert", "{text}", "{missing}", "--to", "2026"],
     "kvcache convert: error: {text}: " + NOT_A_STATE.format(size=f" ({len(TEXT)} bytes)")),
    ("cli-convert-truncated-sequence-file", ["convert", "{ggsq}", "{missing}", "--to", "2025"],
     re.compile(r"kvcache convert: error: {ggsq}: a truncated sequence file: it breaks off in the part that "
                r"starts at byte \d+ of {ggsq_size}")),
    ("cli-convert-truncated-blob", ["convert", "{blob}", "{missing}", "--to", "2025"],
     re.compile(r"kvcache convert: error: {blob}: a truncated 2026 sequence blob: it breaks off in the part "
                r"that starts at byte \d+ of 40")),
]


@pytest.fixture
def files(tmp_path):
    """The files the command-line rows name, and their sizes (``NAME_size``)."""
    seq = _sequence_file()
    contents = {"text": TEXT, "empty": b"", "ggsq": seq[:len(seq) - 10], "ggsq_head": seq[:10],
                "ggsq_newer": seq[:4] + (9).to_bytes(4, "little") + seq[8:],
                "blob": _blob_2026()[:40]}
    out = {"missing": str(tmp_path / "missing.bin")}
    for name, data in contents.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(data)
        out[name] = str(p)
        out[f"{name}_size"] = str(len(data))
    return out


def _fill(text, names, escape):
    for k in sorted(names, key=len, reverse=True):
        text = text.replace("{" + k + "}", re.escape(names[k]) if escape else names[k])
    return text


@pytest.mark.parametrize("call, expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_the_message_names_what_the_user_gave(call, expected, files, capsys):
    if isinstance(call, list):
        assert main([_fill(a, files, False) for a in call]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        got = captured.err.rstrip("\n")
        assert "\n" not in got
    else:
        with pytest.raises(Exception) as info:
            call()
        got = str(info.value)
    if isinstance(expected, re.Pattern):
        pattern = _fill(expected.pattern, files, True)
        assert re.fullmatch(pattern, got), (got, pattern)
    else:
        assert got == _fill(expected, files, False)


def test_the_table_has_a_row_per_call():
    assert len(TABLE) >= 40
    assert len({row[0] for row in TABLE}) == len(TABLE)


PARAMETERS = {
    kvcache.UnifiedCache: ["kv_size", "n_layer", "n_embd_k_gqa", "n_embd_v_gqa", "type_k", "type_v", "v_trans",
                           "n_seq_max", "n_pad", "n_swa", "swa_type", "layers", "buffers", "n_embd_head_k", "rope",
                           "semantics", "kv_unified", "cell_ext", "ple_token"],
    kvcache.RecurrentCache: ["n_seq_max", "n_layer", "n_embd_k_gqa", "n_embd_v_gqa", "type_k", "type_v", "kv_size",
                             "n_embd_k_s", "n_embd_v_s", "buffers", "semantics", "n_rs_seq"],
    kvcache.ISWACache: ["kv_size", "n_layer", "n_embd_k_gqa", "n_embd_v_gqa", "swa_layers", "n_swa", "swa_type",
                        "n_batch", "swa_full", "type_k", "type_v", "v_trans", "n_seq_max", "n_pad", "buffers",
                        "n_embd_head_k", "rope", "semantics", "kv_unified", "cell_ext", "ple_token", "layers"],
    kvcache.UBatch: ["pos", "seq_id", "n_seq_tokens", "output", "tokens", "pos_x", "pos_y"],
    kvcache.Batch: ["pos", "seq_id", "output", "logits_all", "simple_split", "tokens", "pos_x", "pos_y"],
    kvcache.Cells: ["pos", "shift", "seq_mask", "ext"],
    kvcache.StreamUpdate: ["status", "had_shift", "copies", "has_shift", "shift", "rotated"],
    kvcache.RopeParams: ["n_rot", "mode", "n_ctx_orig", "freq_base", "freq_scale", "ext_factor", "attn_factor",
                         "beta_fast", "beta_slow", "freq_factors", "layer_freq_base", "layer_freq_scale"],
}


@pytest.mark.parametrize("cls", list(PARAMETERS), ids=lambda c: c.__name__)
def test_signature_shows_the_real_parameters(cls):
    sig = inspect.signature(cls)
    assert list(sig.parameters) == PARAMETERS[cls]
    required = [n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty]
    # the required ones are exactly those a call without arguments reports missing
    with pytest.raises(TypeError) as info:
        cls()
    assert str(info.value).startswith(f"{cls.__name__}() missing {len(required)} required positional argument")
    assert all(f"'{n}'" in str(info.value) for n in required)


def test_signature_defaults_are_the_constructors():
    """A call with the defaults the signature shows builds what a call without them builds."""
    sig = inspect.signature(kvcache.UnifiedCache)
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    a = kvcache.UnifiedCache(256, 1, 64, 64)
    b = kvcache.UnifiedCache(256, 1, 64, 64, **defaults)
    assert (a.type_k, a.type_v, a.v_trans, a.n_seq_max, a.semantics) == (b.type_k, b.type_v, b.v_trans, b.n_seq_max,
                                                                         b.semantics)
    ub = kvcache.UBatch([0, 1], [0, 0], **{n: p.default for n, p in inspect.signature(kvcache.UBatch).parameters.items()
                                            if p.default is not inspect.Parameter.empty})
    assert ub.n_tokens == 2 and ub.tokens is None


def test_update_plan_signature_shows_the_real_parameters():
    """UpdatePlan's parameters all have defaults: its signature shows them, and it builds with none."""
    sig = inspect.signature(kvcache.UpdatePlan)
    assert list(sig.parameters) == ["k_shift", "rotated", "defrag_runs", "moved", "need_reserve"]
    plan = kvcache.UpdatePlan(**{n: p.default for n, p in sig.parameters.items()})
    assert not plan and plan.k_shift is None and plan.defrag_runs is None


def test_ubatch_keywords_bind_as_the_signature_says():
    """UBatch binds its arguments itself for the common calls: every way of passing them builds the
    same ubatch as the positional call."""
    a = kvcache.UBatch([0, 1, 2, 3], [0, 1], 2, [True, False, True, False], tokens=[5, 6, 7, 8])
    for args, kw in [(([0, 1, 2, 3],), dict(seq_id=[0, 1], n_seq_tokens=2, output=[True, False, True, False],
                                             tokens=[5, 6, 7, 8])),
                     ((), dict(pos=[0, 1, 2, 3], seq_id=[0, 1], n_seq_tokens=2, output=[True, False, True, False],
                               tokens=[5, 6, 7, 8])),
                     (([0, 1, 2, 3], [0, 1], 2), dict(output=[True, False, True, False], tokens=[5, 6, 7, 8]))]:
        b = kvcache.UBatch(*args, **kw)
        assert (b.pos.tolist(), b.seq_id, b.n_seq_tokens, b.output.tolist(), b.tokens.tolist()) == \
            (a.pos.tolist(), a.seq_id, a.n_seq_tokens, a.output.tolist(), a.tokens.tolist())
    c = kvcache.UBatch([0, 1], [0, 0], pos_x=[1, 2], pos_y=[3, 4])
    assert c.pos_x.tolist() == [1, 2] and c.pos_y.tolist() == [3, 4] and c.tokens is None
