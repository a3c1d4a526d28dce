"""The Arrow form of codes: every codec's codes round-trip bit for bit (whole, sliced, in
several chunks, beside other columns), and a table that is not tqvec codes, or not these,
raises FormatError naming what is wrong."""

import json

import numpy as np
import pytest
import torch

import tqvec

pa = pytest.importorskip("pyarrow")

X = np.random.default_rng(2).standard_normal((300, 64)).astype(np.float32)
CODECS = [tqvec.TurboQuant(64, bits=3, seed=1), tqvec.TurboQuant(64, bits=2, variant="prod"),
          tqvec.QJL(64, 96, seed=2), tqvec.PolarQuant(64, seed=0),
          tqvec.TurboQuant(64, bits=4, norm_dtype="float16")]


def _equal(a, b):
    assert torch.equal(a.payload, b.payload) and dict(a.params) == dict(b.params)
    assert a.scalars.keys() == b.scalars.keys()
    for k in a.scalars:
        assert a.scalars[k].dtype == b.scalars[k].dtype and torch.equal(a.scalars[k], b.scalars[k])


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_round_trip(codec):
    codes = codec.encode(X)
    table = tqvec.codes_to_arrow(codes, {"id": np.arange(300), "text": [str(i) for i in
                                                                        range(300)]})
    assert table.column("tqvec_payload").type == pa.binary(codec.payload_bytes)
    _equal(tqvec.codes_from_arrow(table), codes)
    _equal(tqvec.codes_from_arrow(table.slice(40, 100)), codes[40:140])
    chunked = pa.concat_tables([table.slice(0, 7), table.slice(7, 200), table.slice(207)])
    _equal(tqvec.codes_from_arrow(chunked), codes)
    _equal(tqvec.codes_from_arrow(table.to_batches()[0]), codes)
    _equal(tqvec.codes_from_arrow(table.slice(0, 0)), codes[0:0])


def test_parquet_round_trip(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    codes = CODECS[0].encode(X)
    pq.write_table(tqvec.codes_to_arrow(codes), tmp_path / "c.parquet")
    _equal(tqvec.codes_from_arrow(pq.read_table(tmp_path / "c.parquet")), codes)


def test_foreign_and_mismatched_tables_raise():
    codes = CODECS[0].encode(X)
    table = tqvec.codes_to_arrow(codes)
    meta = dict(table.schema.metadata)
    with pytest.raises(tqvec.FormatError, match="not tqvec codes"):
        tqvec.codes_from_arrow(pa.table({"a": [1, 2]}))
    with pytest.raises(TypeError, match="table must be"):
        tqvec.codes_from_arrow({"a": [1]})
    bad = {**meta, b"tqvec.params": b"{"}
    with pytest.raises(tqvec.FormatError, match="params"):
        tqvec.codes_from_arrow(table.replace_schema_metadata(bad))
    other = json.dumps(dict(CODECS[0].params, bits=2), sort_keys=True).encode()
    with pytest.raises(tqvec.FormatError, match="fixed_size_binary"):
        tqvec.codes_from_arrow(table.replace_schema_metadata({**meta,
                                                              b"tqvec.params": other}))
    seeded = json.dumps(dict(CODECS[0].params, seed=5), sort_keys=True).encode()
    with pytest.raises(tqvec.FormatError, match="fingerprint"):
        tqvec.codes_from_arrow(table.replace_schema_metadata({**meta,
                                                              b"tqvec.params": seeded}))
    with pytest.raises(tqvec.FormatError, match="missing"):
        tqvec.codes_from_arrow(table.drop_columns(["tqvec_norm"]))
    nan = table.set_column(1, "tqvec_norm", pa.array(np.full(300, np.nan, np.float32)))
    with pytest.raises(tqvec.FormatError, match="NaN"):
        tqvec.codes_from_arrow(nan)
    as64 = table.set_column(1, "tqvec_norm", pa.array(np.ones(300)))
    with pytest.raises(tqvec.FormatError, match="float"):
        tqvec.codes_from_arrow(as64)
    with pytest.raises(ValueError, match="rows"):
        tqvec.codes_to_arrow(codes, {"id": np.arange(3)})
