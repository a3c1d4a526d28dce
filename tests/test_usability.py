"""A newcomer's first hour: faiss parity where a faiss user expects it, a CLI that never eats a
file and documents itself, a main job that writes where it says and refuses bad arguments
before any work, and errors that tell the truth."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import tqvec
from tqvec import FormatError
from tqvec.cli import main

# -- faiss parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["TQ4", "IVF4,TQ2", "PCA,TQ2", "Center,TQ2f"])
def test_the_default_metric_is_l2_as_in_faiss(spec, rng):
    faiss = pytest.importorskip("faiss")
    index = tqvec.index_factory(16, spec)
    assert index.metric_type == faiss.METRIC_L2
    x = rng.standard_normal((300, 16)).astype(np.float32)
    if not index.is_trained:
        index.train(x)
    index.add(x)
    D, I = index.search(x[:5], 3)
    assert (np.diff(D, axis=1) >= 0).all()  # distances, ascending


def test_range_search_lims_are_uint64_as_in_faiss(rng):
    x = rng.standard_normal((200, 16)).astype(np.float32)
    for index in (tqvec.index_factory(16, "TQ4"), tqvec.index_factory(16, "IVF2,TQ4")):
        if not index.is_trained:
            index.train(x)
        index.add(x)
        lims, D, I = index.range_search(x[:3], 20.0)
        assert lims.dtype == np.uint64 and lims.shape == (4,) and int(lims[-1]) == len(D)
        assert D.dtype == np.float32 and I.dtype == np.int64


@pytest.mark.parametrize("spec,hint", [
    ("Flat", "IndexFlat"), ("IVF256,Flat", "IndexFlat"), ("SQ8", "'TQ8'"), ("IVF64,SQ4", "TQ"),
    ("PQ16x8", "PCA,TQ"), ("IVF256,PQ16", "PCA,TQ"), ("OPQ16,PQ16", "PCA,TQ"),
    ("HNSW32", "HNSW{M},TQ{b}"), ("HNSW32,Flat", "HNSW{M},TQ{b}"), ("NSG32", "HNSW{M},TQ{b}"),
    ("RR,TQ4", "'TQ4'"), ("L2norm,TQ4", "cosine"),
    ("PCA64,TQ4", "PCA,TQ"), ("LSH", "QJL"), ("RaBitQ", "TQ{b}u")])
def test_faiss_factory_strings_are_refused_with_what_to_use(spec, hint):
    with pytest.raises(ValueError, match="is a faiss index type tqvec does not build") as e:
        tqvec.index_factory(64, spec)
    assert hint in str(e.value)


@pytest.mark.parametrize("prefix", ["IDMap,", "IDMap2,"])
def test_idmap_is_accepted_every_index_takes_ids(prefix, rng):
    index = tqvec.index_factory(16, prefix + "TQ4")
    x = rng.standard_normal((50, 16)).astype(np.float32)
    index.add_with_ids(x, np.arange(1000, 1050))
    assert index.search(x[:1], 1)[1][0, 0] == 1000


# -- the CLI never destroys data ------------------------------------------------------------


@pytest.fixture
def npy(tmp_path, rng):
    path = tmp_path / "x.npy"
    np.save(path, rng.standard_normal((30, 16)).astype(np.float32))
    return path


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tqvec {tqvec.__version__}"


def test_an_existing_output_needs_force(npy, tmp_path, capsys):
    out = tmp_path / "x.tqc"
    out.write_bytes(b"keep me")
    assert main(["encode", str(npy), str(out)]) == 2
    assert "exists: pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"
    assert main(["encode", str(npy), str(out), "--force"]) == 0
    assert len(tqvec.load_codes(out)) == 30
    dec = tmp_path / "y.npy"
    np.save(dec, np.zeros(3))
    assert main(["decode", str(out), str(dec)]) == 2
    assert np.load(dec).shape == (3,)
    assert main(["decode", str(out), str(dec), "--force"]) == 0 and np.load(dec).shape == (30, 16)


@pytest.mark.parametrize("cmd", ["encode", "decode"])
def test_output_is_never_the_input_not_even_through_a_hard_link(cmd, npy, tmp_path, capsys):
    src = npy
    if cmd == "decode":
        src = tmp_path / "x.tqc"
        assert main(["encode", str(npy), str(src)]) == 0
    before = src.read_bytes()
    link = tmp_path / "link"
    os.link(src, link)
    for out in (src, link):
        assert main([cmd, str(src), str(out), "--force"]) == 2
        assert "must not be the input" in capsys.readouterr().err
    assert src.read_bytes() == before


@pytest.mark.parametrize("cmd", [[], ["encode"], ["decode"], ["info"], ["demo"], ["bench"]])
def test_every_help_shows_defaults_and_examples(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "example" in text
    if cmd in (["encode"], ["demo"], ["bench"]):
        assert "(default: " in text


def test_a_text_file_named_npy_is_called_what_it_is(tmp_path, capsys):
    (tmp_path / "t.npy").write_text("hello\n" * 5)
    assert main(["encode", str(tmp_path / "t.npy"), str(tmp_path / "o.tqc")]) == 2
    err = capsys.readouterr().err
    assert "does not start with numpy's magic" in err and "pickle" not in err


def test_sketch_dim_zero_is_an_error_not_a_default(npy, tmp_path, capsys):
    assert main(["encode", str(npy), str(tmp_path / "o.tqc"), "--codec", "qjl",
                 "--sketch-dim", "0"]) == 2
    assert "sketch_dim must be in 1.." in capsys.readouterr().err
    with pytest.raises(ValueError, match="sketch_dim"):
        tqvec.QJL(32, sketch_dim=0)


@pytest.mark.parametrize("args", [["--n", "0"], ["--dim", "-3"], ["--bits", "9"],
                                  ["--bits", "a"]])
def test_demo_refuses_bad_arguments_before_any_work(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--dataset", "random", *args])
    assert e.value.code == 2 and "error: argument" in capsys.readouterr().err


# -- the main job ---------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--dataset", "no-such-set"], ["--bits", "0"],
                                  ["--bits", "2,9"], ["--nq", "0"], ["--min-time", "0"]])
def test_bench_refuses_bad_arguments_before_any_work(args, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["bench", *args, "--out", str(out)])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
    assert not out.exists()


def test_bench_writes_to_a_user_directory_never_the_source_tree(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("faiss")
    from tqvec.benchmark import default_out

    monkeypatch.delenv("TQVEC_DATA", raising=False)
    assert default_out() == "tqvec-bench"
    monkeypatch.setenv("TQVEC_DATA", str(tmp_path / "data"))
    assert default_out() == str(tmp_path / "data" / "bench")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--bits", "1", "--only", "TQ1", "--single", "2", "--min-time",
                 "0.01", "--quiet"]) == 0
    written = tmp_path / "data" / "bench" / "search_digits.json"
    assert str(written) in capsys.readouterr().out
    assert json.loads(written.read_text())["complete"]


def test_bench_removes_a_stale_plot_it_cannot_redraw(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("faiss")
    import tqvec.benchmark as bench

    (tmp_path / "search_digits.png").write_bytes(b"old plot")
    monkeypatch.setattr(bench, "plot", lambda *a, **k: False)
    assert main(["bench", "--bits", "1", "--only", "TQ1", "--single", "2", "--min-time",
                 "0.01", "--quiet", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "search_digits.png").exists()
    assert "no plot: pip install matplotlib" in capsys.readouterr().out


def test_faiss_warnings_are_kept_out_of_the_terminal_and_counted():
    from tqvec.benchmark import _Stderr

    err = _Stderr()
    with err.capture():
        os.write(2, b"WARNING clustering 100 points to 256 centroids: please provide more\n")
    assert len(err.lines) == 1 and "1 warning lines" in err.summary()
    assert _Stderr().summary() is None


# -- errors that tell the truth -------------------------------------------------------------


@pytest.fixture
def codes_file(tmp_path, rng):
    path = tmp_path / "c.tqc"
    codec = tqvec.TurboQuant(16, 4)
    tqvec.save_codes(path, codec.encode(rng.standard_normal((10, 16)).astype(np.float32)))
    return path


def test_a_damaged_version_field_is_called_damage(codes_file):
    raw = bytearray(codes_file.read_bytes())
    raw[8:12] = struct.pack("<I", 4294901761)
    codes_file.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="is damaged: its format version field reads "
                                          "4294901761") as e:
        tqvec.load_codes(codes_file)
    assert "upgrade" not in str(e.value)
    raw[8:12] = struct.pack("<I", 2)
    codes_file.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="newer than this tqvec reads .*upgrade tqvec"):
        tqvec.load_codes(codes_file)


@pytest.mark.parametrize("size", [3, 8, 10, 15])
def test_a_truncated_file_is_called_truncated_not_foreign(codes_file, size):
    codes_file.write_bytes(codes_file.read_bytes()[:size])
    with pytest.raises(FormatError, match=f"is truncated: {size} bytes"):
        tqvec.load_codes(codes_file)


def test_a_foreign_file_is_called_foreign(codes_file):
    codes_file.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(FormatError, match="is not a tqvec file"):
        tqvec.load_codes(codes_file)


def test_integer_input_names_the_dtype_it_came_with():
    import torch

    codec = tqvec.TurboQuant(16, 4)
    with pytest.raises(TypeError, match=r"got numpy int64 .*x\.astype\(np\.float32\)"):
        codec.encode(np.zeros((3, 16), np.int64))
    with pytest.raises(TypeError, match=r"got torch\.int32 .*x\.float\(\)"):
        codec.encode(torch.zeros((3, 16), dtype=torch.int32))


def test_an_untrained_ivf_index_raises_the_same_error_on_add_and_search(rng):
    index = tqvec.index_factory(16, "IVF4,TQ2")
    x = rng.standard_normal((10, 16)).astype(np.float32)
    for call in (lambda: index.add(x), lambda: index.search(x, 2),
                 lambda: index.add_with_ids(x, np.arange(10))):
        with pytest.raises(ValueError, match="must be trained before"):
            call()
