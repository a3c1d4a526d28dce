import gzip
import struct

import numpy as np
import pytest

from tqvec import FormatError
from tqvec import datasets as ds

h5py = pytest.importorskip("h5py")
pytest.importorskip("faiss")


def _idx(path, arr):
    with gzip.open(path, "wb") as f:
        f.write(b"\0\0\x08" + bytes([arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape))
        f.write(arr.astype(np.uint8).tobytes())


def test_hdf5_round_trip_with_exact_ground_truth(tmp_path, rng):
    train = rng.standard_normal((300, 12)).astype(np.float32)
    test = rng.standard_normal((7, 12)).astype(np.float32)
    for dist in ("euclidean", "angular", "dot"):
        ds.write_hdf5(str(tmp_path / "a.hdf5"), train, test, dist, k=10)
        got = ds.read_hdf5(str(tmp_path / "a.hdf5"))
        assert got["distance"] == dist and got["neighbors"].shape == (7, 10)
        np.testing.assert_array_equal(got["train"], train)
        if dist == "euclidean":
            d2 = ((test[:, None, :] - train[None]) ** 2).sum(-1)
            np.testing.assert_array_equal(got["neighbors"][:, 0], d2.argmin(1))


def test_hdf5_schema_errors(tmp_path):
    p = str(tmp_path / "bad.hdf5")
    with h5py.File(p, "w") as f:
        f.create_dataset("train", data=np.zeros((4, 3), np.float32))
    with pytest.raises(FormatError, match="missing \\['test', 'neighbors'\\]"):
        ds.read_hdf5(p)
    with h5py.File(p, "w") as f:
        f.attrs["distance"] = "hamming"
        for k, v in (("train", np.zeros((4, 3))), ("test", np.zeros((2, 3))),
                     ("neighbors", np.zeros((2, 1), np.int32))):
            f.create_dataset(k, data=v)
    with pytest.raises(FormatError, match="distance'\\] must be one of"):
        ds.read_hdf5(p)
    (tmp_path / "junk.hdf5").write_bytes(b"not hdf5")
    with pytest.raises(FormatError, match="not a readable HDF5"):
        ds.read_hdf5(str(tmp_path / "junk.hdf5"))


def test_fashion_recipe_from_any_folder(tmp_path, rng, monkeypatch):
    src = tmp_path / "idx"
    src.mkdir()
    _idx(src / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (50, 28, 28)))
    _idx(src / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (5, 28, 28)))
    monkeypatch.setenv("TQVEC_DATA", str(tmp_path / "cache"))
    out = ds.build_fashion_mnist(str(src))
    got = ds.load_ann("fashion-mnist-784-euclidean")
    assert out.startswith(str(tmp_path / "cache"))
    assert got["train"].shape == (50, 784) and got["test"].shape == (5, 784)
    assert got["neighbors"].shape == (5, 50)  # k capped by n
    with pytest.raises(FileNotFoundError, match="Fashion-MNIST idx files not found"):
        ds.build_fashion_mnist(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no dataset 'glove-25-angular'"):
        ds.load_ann("glove-25-angular")


def test_idx_reader_rejects_truncated_files(tmp_path):
    p = tmp_path / "t.gz"
    with gzip.open(p, "wb") as f:
        f.write(b"\0\0\x08\x02" + struct.pack(">2I", 4, 4) + b"\0" * 10)
    with pytest.raises(FormatError, match="truncated"):
        ds.read_idx(str(p))


def test_embedded_datasets():
    pytest.importorskip("sklearn")
    x = ds.load_embedded("digits")
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert ds.load_embedded("random", n=10, dim=5).shape == (10, 5)
    with pytest.raises(ValueError, match="dataset must be one of"):
        ds.load_embedded("mnist")


def _minilm_recipe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "datasets" / "minilm.py"
    spec = importlib.util.spec_from_file_location("minilm_recipe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_minilm_recipe_reads_wordnet_glosses(tmp_path):
    recipe = _minilm_recipe()
    (tmp_path / "data.noun").write_text(
        "  1 This software and database is being provided to you, the LICENSEE\n"
        "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived to exist\n"
        "00001930 03 n 01 physical_entity 0 | an entity that has physical existence\n"
        "00002137 03 n 02 abstraction 0 no gloss on this line\n")
    (tmp_path / "data.verb").write_text(
        "00001740 29 v 04 breathe 0 | draw air into, and expel out of, the lungs; "
        "\"I can breathe\"\n")
    got = recipe.wordnet_glosses(str(tmp_path))
    assert got == ["that which is perceived to exist", "an entity that has physical existence",
                   "draw air into, and expel out of, the lungs; \"I can breathe\""]
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        recipe.wordnet_glosses(str(tmp_path / "missing"))


def test_minilm_recipe_refuses_more_passages_than_it_has(tmp_path, monkeypatch):
    recipe = _minilm_recipe()
    text = tmp_path / "t.txt"
    text.write_text("a passage that is long enough to count\n" * 3 + "short\n")
    monkeypatch.setattr(recipe, "embed", lambda *a, **k: pytest.fail("must not embed"))
    with pytest.raises(ValueError, match="train \\+ test"):
        recipe.build(train=2, test=1, texts=[str(text)], out=str(tmp_path / "o.hdf5"))
