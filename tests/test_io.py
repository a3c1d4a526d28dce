import struct

import numpy as np
import pytest
import torch

import tqvec
from tqvec import FormatError
from tqvec.io import MAGIC, read_container, write_container


@pytest.fixture
def saved(tmp_path, rng):
    x = rng.standard_normal((100, 24)).astype(np.float32)
    c = tqvec.TurboQuant(24, 3, "prod", seed=5)
    codes = c.encode(x)
    path = tmp_path / "x.tqc"
    tqvec.save_codes(path, codes)
    return path, codes, c


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip(saved, mmap):
    path, codes, c = saved
    back = tqvec.load_codes(path, mmap=mmap)
    assert torch.equal(back.payload, codes.payload)
    for k, v in codes.scalars.items():
        assert torch.equal(back.scalars[k], v)
    assert dict(back.params) == c.params
    torch.testing.assert_close(c.decode(back), c.decode(codes))
    assert [p.name for p in path.parent.iterdir()] == ["x.tqc"]  # no temp files left


def test_every_codec_round_trips(tmp_path, rng):
    x = rng.standard_normal((10, 32)).astype(np.float32)
    for c in (tqvec.TurboQuant(32, 4), tqvec.QJL(32, 40, outliers=[3]), tqvec.PolarQuant(32)):
        tqvec.save_codes(tmp_path / "c.tqc", c.encode(x))
        back = tqvec.load_codes(tmp_path / "c.tqc")
        np.testing.assert_array_equal(c.decode(back, like=x), c.decode(c.encode(x), like=x))


def test_empty_codes_round_trip(tmp_path):
    c = tqvec.TurboQuant(16, 2)
    tqvec.save_codes(tmp_path / "e.tqc", c.encode(np.zeros((0, 16), np.float32)))
    assert len(tqvec.load_codes(tmp_path / "e.tqc", mmap=True)) == 0


def test_truncated_files_fail_cleanly(saved):
    path, _, _ = saved
    data = path.read_bytes()
    for cut in (0, 5, 12, 40, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(FormatError):
            tqvec.load_codes(path)


def test_wrong_magic_and_foreign_files(tmp_path, saved):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="not a tqvec file"):
        tqvec.load_codes(path)
    np.save(tmp_path / "a.npy", np.zeros(10))
    with pytest.raises(FormatError, match="not a tqvec file"):
        tqvec.load_codes(tmp_path / "a.npy")
    with pytest.raises(FileNotFoundError):
        tqvec.load_codes(tmp_path / "missing.tqc")


@pytest.mark.parametrize("mmap", [False, True])
def test_flipped_bytes_are_detected_everywhere(saved, mmap):
    """Mapped or read, every section is checksummed (a mapped load reads the file once)."""
    path, _, _ = saved
    data = path.read_bytes()
    hlen = struct.unpack("<I", data[12:16])[0]
    for pos in (20, 16 + hlen + 3, len(data) - 1, len(data) - 500):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(FormatError, match="corrupted|checksum"):
            tqvec.load_codes(path, mmap=mmap)


def test_newer_format_version_is_refused(saved):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 99)
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="format version 99"):
        tqvec.load_codes(path)


def test_fingerprint_mismatch_is_refused(saved):
    path, codes, c = saved
    meta, arrays, _ = read_container(path, "codes")
    meta["fingerprint"] = "0" * 64
    write_container(path, "codes", meta, arrays)
    with pytest.raises(FormatError, match="fingerprint mismatch"):
        tqvec.load_codes(path)


def _forged_dim(path, kind, dim):
    """The file with its codec's dim replaced (checksums recomputed): a header no payload backs
    (a QJL payload's size depends on sketch_dim only)."""
    meta, arrays, _ = read_container(path, kind)
    meta["params"]["dim"] = dim
    meta["params"].pop("jl_version", None)  # version 1: a dim x dim Haar draw for m < dim
    write_container(path, kind, meta, arrays)


@pytest.mark.parametrize("mmap", [False, True])
def test_forged_header_costs_no_draw_at_load(tmp_path, mmap, monkeypatch, refuse_draws):
    """Refusing a file costs what reading it costs: a 1 KB file claiming dim 1,024 (a 1024 x
    1024 Haar draw) loads without drawing, and its first use refuses it."""
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    path = tmp_path / "q.tqc"
    tqvec.save_codes(path, tqvec.QJL(16, 24, seed=4, outliers=[2, 5]).encode(x))
    _forged_dim(path, "codes", 1024)
    assert path.stat().st_size < 2048
    with monkeypatch.context() as m:
        refuse_draws(m)
        codes = tqvec.load_codes(path, mmap=mmap)
    with pytest.raises(FormatError, match="fingerprint mismatch"):
        tqvec.codec_from_params(codes.params).decode(codes[:2])


def test_forged_index_header_is_refused_at_first_search(tmp_path, monkeypatch,
                                                        refuse_draws):
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    index = tqvec.FlatIndex(tqvec.QJL(16, 24, seed=4), "ip")
    index.add(x)
    path = tmp_path / "i.tqv"
    tqvec.write_index(index, path)
    _forged_dim(path, "index", 1024)
    with monkeypatch.context() as m:
        refuse_draws(m)
        back = tqvec.read_index(path)
    with pytest.raises(FormatError, match="fingerprint mismatch"):
        back.search(np.ones((1, 1024), np.float32), 1)


def test_genuine_file_with_costly_draw_checks_at_first_use(tmp_path):
    """A small file whose codec's draw is large is checked when first used, and then works."""
    x = np.random.default_rng(0).standard_normal((2, 2048)).astype(np.float32)
    c = tqvec.QJL(2048, 4096, seed=1, jl="gaussian")
    path = tmp_path / "g.tqc"
    tqvec.save_codes(path, c.encode(x))
    back = tqvec.load_codes(path)
    assert type(back.source).__name__ == "PendingFingerprints"
    torch.testing.assert_close(tqvec.QJL(2048, 4096, seed=1, jl="gaussian").decode(back),
                               c.decode(c.encode(x)))


def test_wrong_kind_is_refused(tmp_path):
    write_container(tmp_path / "i.tqc", "index", {}, {"a": np.zeros(3, np.uint8)})
    with pytest.raises(FormatError, match="holds a 'index', expected 'codes'"):
        tqvec.load_codes(tmp_path / "i.tqc")


def test_files_start_with_magic(saved):
    assert saved[0].read_bytes()[:8] == MAGIC
