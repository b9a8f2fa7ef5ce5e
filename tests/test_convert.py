"""kvcache.convert.convert and `kvcache convert`: a state file in another layout, without a
cache. The 0.3.10 files of tests/data/interop become, byte for byte, what 0.3.36 wrote for
the same scenario in tests/data/interop-v10 (the K/V payload did not change; mamba's state values
did, so there only the framing is compared), and back, less what the target cannot hold."""
import io
import json
import struct

import pytest

import kvcache
from kvcache import statefile
from kvcache.convert import convert
from kvcache.cli import main

from interop_data import interop_dir, interop_v10_dir, make_cache, manifest

UNIFIED = ["llama_fa0", "llama_fa1", "llama_q8_fa1"]
FILES = ["seq0.bin", "seq1.bin", "seq2.bin", "state.bin", "session.ggsn", "seq0.ggsq"]


def _ctx(obj):
    return obj.context if isinstance(obj, statefile.SessionFile) else obj


@pytest.mark.parametrize("folder", UNIFIED)
@pytest.mark.parametrize("name", FILES)
def test_old_files_become_todays(folder, name):
    old, new = interop_dir() / folder / name, interop_v10_dir() / folder / name
    seq_id = manifest(new).get("seq_id")
    c = convert(old.read_bytes(), "2026", seq_id=seq_id)
    assert c.data == new.read_bytes() and (c.source, c.layout) == ("2025", "2026")
    back = convert(new.read_bytes(), "2025")
    if name in ("state.bin", "session.ggsn"):
        # 2025 holds the outputs of the last batch, which 2026 dropped: none are written
        assert any("no outputs written" in n for n in back.notes)
        assert any("left out 1 outputs, 300 logits" in n for n in c.notes)
        ctx = _ctx(statefile.parse(back.data))
        assert ctx.n_outputs == 0 and bytes(ctx.cache) == bytes(_ctx(statefile.parse(old.read_bytes())).cache)
    else:
        assert back.data == old.read_bytes()
        if name.endswith(".bin"):
            assert any("prefix (source seq" in n for n in back.notes)


@pytest.mark.parametrize("name", FILES)
def test_recurrent_files_change_their_framing_only(name):
    new = interop_v10_dir() / "mamba" / name
    data = new.read_bytes()
    old = convert(data, "2025")
    again = convert(old.data, "2026", seq_id=manifest(new).get("seq_id"))
    assert again.data == data
    m = manifest(new)
    cache = make_cache(m)
    seq_id = m.get("seq_id", -1)
    obj = statefile.parse(old.data)
    if isinstance(obj, memoryview):
        cache.state_read(obj, seq_id, layout="2025")
    elif isinstance(obj, statefile.SequenceFile):
        obj.restore(cache, seq_id)
    else:
        obj.restore(cache)
    assert cache.used == m["expected"]["sections"][0]["cell_count"]


def test_every_intermediate_layout_reads_back():
    data = (interop_v10_dir() / "llama_fa0" / "session.ggsn").read_bytes()
    m = manifest(interop_v10_dir() / "llama_fa0" / "session.ggsn")
    want = make_cache(m)
    statefile.parse(data).restore(want)
    for to in kvcache.LAYOUTS:
        c = convert(data, to)
        f = statefile.parse(c.data)
        # the layouts 2026-03 to 2026-06 write the same session files: read as the newest of them
        info, found = statefile.layout_info(to), statefile.layout_info(f.layout)
        assert f.version == info["session_version"]
        assert (found["outputs"], found["streams"], found["session_version"]) == \
            (info["outputs"], info["streams"], info["session_version"])
        got = make_cache(m)
        f.restore(got)
        assert got.state_write(-1) == want.state_write(-1), to
        assert convert(c.data, "2026").data == data


def test_what_cannot_be_converted_is_refused_plainly():
    empty_new = (interop_v10_dir() / "llama_fa0" / "seq3.bin").read_bytes()
    with pytest.raises(kvcache.StateError, match="empty, written as its cell count alone: layout 2025 writes"):
        convert(empty_new, "2025")
    empty_old = (interop_dir() / "llama_fa0" / "seq3.bin").read_bytes()
    with pytest.raises(kvcache.StateError, match="unified or a recurrent cache's state.*pass variant"):
        convert(empty_old, "2026")
    c = convert(empty_old, "2026", variant="unified", seq_id=3)
    assert c.data == empty_new
    streams = (interop_v10_dir() / "llama_fa0_streams" / "seq1.bin").read_bytes()
    with pytest.raises(kvcache.StateError, match="4 streams; layout 2025 has one stream"):
        convert(streams, "2025")
    assert convert(streams, "2026-05").data == streams
    with pytest.raises(ValueError, match="unknown layout '2027'"):
        convert(empty_new, "2027")
    with pytest.raises(kvcache.StateError):
        convert(b"\x01\x02\x03", "2026")


def test_a_prefix_needs_a_sequence_id():
    old = (interop_dir() / "llama_fa0" / "seq1.bin").read_bytes()
    c = convert(old, "2026")
    assert struct.unpack_from("<I", c.data)[0] == 1 and any("pass seq_id" in n for n in c.notes)  # n_stream 1
    c = convert(old, "2026", seq_id=2)
    assert struct.unpack_from("<Ii", c.data) == (statefile.SEQ_MAGIC, 2)


def test_iswa_sequence_states_say_what_the_window_does():
    old = (interop_dir() / "gemma2_fa0" / "seq0.bin").read_bytes()
    c = convert(old, "2026", seq_id=0)
    assert any("outside the window were kept" in n for n in c.notes)
    m = manifest(interop_dir() / "gemma2_fa0" / "seq0.bin")
    cache = make_cache(m)
    assert cache.state_read(c.data, 0, exact=True) == len(c.data)
    assert cache.state_write(0, layout="2025") == old


def test_iswa_sequence_states_lose_the_cells_outside_the_window_given_it():
    """With the window (the state does not hold it), converting an old sequence state to a
    layout that trims leaves out the SWA cells outside it: the bytes a cache of the model writes
    in that layout, with a note saying how many; a sequence file the same."""
    old = (interop_dir() / "gemma2_fa0" / "seq0.bin").read_bytes()
    m = manifest(interop_dir() / "gemma2_fa0" / "seq0.bin")
    swa = m["geometry"][1]
    cache = make_cache(m)
    cache.state_read(old, 0, layout="2025")
    for to in ("2026-06", "2026"):
        c = convert(old, to, seq_id=0, n_swa=swa["n_swa"], swa_type=swa["swa_type"])
        assert c.data == cache.state_write(0, layout=to)
        assert c.notes == (f"left out 32 of the SWA cache's cells: outside the window (n_swa 8, standard) of the "
                           f"sequence's last position, as layout {to}'s llama.cpp leaves them out",)
    # no trimming where the target keeps them, or the input had left them out already
    c = convert(old, "2026-05", seq_id=0, n_swa=8)
    assert c.data == cache.state_write(0, layout="2026-05") and not c.notes
    new = cache.state_write(0, layout="2026")
    assert convert(new, "2026", n_swa=8).data == new
    # a sequence file of 0.3.10: its state is a sequence's too
    buf = io.BytesIO()
    statefile.write_sequence_file(buf, cache, 0, list(range(40)), layout="2025")
    c = convert(buf.getvalue(), "2026", n_swa=8)
    want = io.BytesIO()
    statefile.write_sequence_file(want, cache, 0, list(range(40)), layout="2026")
    assert c.data == want.getvalue() and "left out 32" in c.notes[0]
    # a whole state keeps every cell: a bare blob of one sequence is taken as a sequence's only
    # with seq_id (a whole state of one sequence has the same bytes)
    whole = cache.state_write(layout="2025")
    c = convert(whole, "2026", n_swa=8)
    assert c.data == cache.state_write(layout="2026") and "pass seq_id" in c.notes[0]
    with pytest.raises(ValueError):
        convert(old, "2026", n_swa=0)
    with pytest.raises(ValueError):
        convert(old, "2026", n_swa=8, swa_type="none")


def test_cli_convert_with_the_window(tmp_path, capsys):
    src = interop_dir() / "gemma2_fa0" / "seq0.bin"
    out = tmp_path / "seq0.bin"
    assert main(["convert", str(src), str(out), "--to", "2026", "--seq-id", "0", "--n-swa", "8"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"{out}: sequence blob, layout 2025 -> 2026, 21560 -> 13000 bytes"
    assert text[1].startswith("  note: left out 32 of the SWA cache's cells: outside the window (n_swa 8")


def test_cli_convert(tmp_path, capsys):
    src = interop_dir() / "llama_fa0" / "state.bin"
    out = tmp_path / "state.bin"
    assert main(["convert", str(src), str(out), "--to", "2026"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"{out}: whole-context state, layout 2025 -> 2026, 24745 -> 23525 bytes"
    assert text[1].startswith("  note: left out 1 outputs, 300 logits and 0 embeddings")
    assert out.read_bytes() == (interop_v10_dir() / "llama_fa0" / "state.bin").read_bytes()
    assert main(["convert", "--json", str(out), str(tmp_path / "back.bin"), "--to", "2025"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["from"], r["to"], r["kind"]) == ("2026", "2025", "whole-context state") and r["notes"]
    assert main(["convert", str(interop_dir() / "llama_fa0" / "seq3.bin"), str(tmp_path / "x"), "--to", "2026"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache convert: error: ") and "pass variant" in err and not (tmp_path / "x").exists()


# --- `kvcache convert`'s sequence id and its options' ranges -----------------------------------

@pytest.mark.parametrize("folder", UNIFIED)
@pytest.mark.parametrize("name", ["seq0.bin", "seq1.bin", "seq2.bin"])
def test_cli_convert_gives_an_old_sequence_blob_the_prefix(folder, name, tmp_path, capsys):
    """0.3.10's sequence blobs have no prefix, which today's llama.cpp requires: without --seq-id
    the prefix names seq 0 (llama.cpp does not use the id), with --seq-id the bytes are 0.3.36's."""
    old, new = interop_dir() / folder / name, interop_v10_dir() / folder / name
    want = new.read_bytes()
    sid = manifest(new)["seq_id"]
    out = tmp_path / name
    assert main(["convert", str(old), str(out), "--to", "2026"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[1] == ("  note: the sequence-blob prefix of layout 2026 names seq 0: the input does not say which "
                       "sequence it is (llama.cpp reads the id and does not use it)")
    got = out.read_bytes()
    assert struct.unpack_from("<Ii", got) == (statefile.SEQ_MAGIC, 0) and got[8:] == want[8:]
    cache = make_cache(manifest(new))
    assert cache.state_read(got, sid, exact=True) == len(got)
    assert main(["convert", str(old), str(out), "--to", "2026", "--seq-id", str(sid)]) == 0
    assert out.read_bytes() == want and len(capsys.readouterr().out.splitlines()) == 1   # no note


def test_cli_convert_keeps_the_prefix_the_input_has(tmp_path, capsys):
    new = interop_v10_dir() / "llama_fa0" / "seq1.bin"
    out = tmp_path / "seq1.bin"
    assert main(["convert", str(new), str(out), "--to", "2026-05"]) == 0
    assert struct.unpack_from("<Ii", out.read_bytes()) == (statefile.SEQ_MAGIC, 1)
    assert main(["convert", str(new), str(out), "--to", "2026", "--seq-id", "3"]) == 0
    assert struct.unpack_from("<Ii", out.read_bytes()) == (statefile.SEQ_MAGIC, 3)


def test_cli_convert_to_a_layout_without_the_prefix_names_no_sequence(tmp_path, capsys):
    old = interop_dir() / "llama_fa0" / "seq1.bin"
    out = tmp_path / "seq1.bin"
    assert main(["convert", str(old), str(out), "--to", "2025-08"]) == 0
    assert "note" not in capsys.readouterr().out and struct.unpack_from("<I", out.read_bytes())[0] == 1   # n_stream


def test_library_convert_checks_the_sequence_id():
    old = (interop_dir() / "llama_fa0" / "seq1.bin").read_bytes()
    for sid, err in ((256, ValueError), (-2, ValueError), (2**40, ValueError), ("1", TypeError)):
        with pytest.raises(err, match="seq_id"):
            convert(old, "2026", seq_id=sid)
    with pytest.raises(ValueError, match=r"^default_seq_id = 300 is outside \[-1, 255\]$"):
        convert(old, "2026", default_seq_id=300)
    c = convert(old, "2026", default_seq_id=5)
    assert struct.unpack_from("<Ii", c.data) == (statefile.SEQ_MAGIC, 5) and "names seq 5" in c.notes[0]


CONVERT_RANGES = [
    (["--seq-id", "99999999999"], "argument --seq-id: must be at most 255, got 99999999999"),
    (["--seq-id", "256"], "argument --seq-id: must be at most 255, got 256"),
    (["--seq-id", "-7"], "argument --seq-id: must be >= 0, got -7"),
    (["--seq-id", "one"], "argument --seq-id: expected a whole number, got 'one'"),
    (["--seq-id", "1.5"], "argument --seq-id: expected a whole number, got '1.5'"),
    (["--n-swa", "0"], "argument --n-swa: must be at least 1, got 0"),
    (["--n-swa", "-7"], "argument --n-swa: must be at least 1, got -7"),
    (["--n-swa", "99999999999"], "argument --n-swa: must be at most 2147483647, got 99999999999"),
]


@pytest.mark.parametrize("opts,msg", CONVERT_RANGES, ids=[" ".join(o) for o, _ in CONVERT_RANGES])
def test_cli_convert_checks_its_numbers(opts, msg, tmp_path, capsys):
    out = tmp_path / "out.bin"
    rc = main(["convert", str(interop_dir() / "llama_fa0" / "seq1.bin"), str(out), "--to", "2026", *opts])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and not out.exists()
    assert captured.err == f"kvcache convert: error: {msg} (see 'kvcache convert --help')\n"


def test_modules_import_downward_only():
    """statefile (the wrappers, detection) < inspect (the report) < convert: no module imports one
    above it, not even inside a function."""
    import ast
    from pathlib import Path

    order = ["kvcache.statefile", "kvcache.inspect", "kvcache.convert"]
    src = Path(kvcache.__file__).parent
    for i, mod in enumerate(order):
        tree = ast.parse((src / (mod.split(".")[1] + ".py")).read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                     for a in n.names}
        above = sorted(m for m in imported if m in order[i + 1:])
        assert not above, f"{mod} imports {above}, above it"
