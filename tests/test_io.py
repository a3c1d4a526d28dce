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


def test_wrong_kind_is_refused(tmp_path):
    write_container(tmp_path / "i.tqc", "index", {}, {"a": np.zeros(3, np.uint8)})
    with pytest.raises(FormatError, match="holds a 'index', expected 'codes'"):
        tqvec.load_codes(tmp_path / "i.tqc")


def test_files_start_with_magic(saved):
    assert saved[0].read_bytes()[:8] == MAGIC
