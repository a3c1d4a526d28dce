import json

import numpy as np
import pytest

import tqvec
from tqvec.cli import main


def test_encode_info_decode(tmp_path, capsys, rng):
    x = rng.standard_normal((500, 40)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "x.tqc"), "--bits", "3",
                 "--variant", "prod"]) == 0
    assert "500 vectors x 40" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "x.tqc")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"]["variant"] == "prod" and info["n"] == 500
    assert main(["decode", str(tmp_path / "x.tqc"), str(tmp_path / "y.npy")]) == 0
    y = np.load(tmp_path / "y.npy")
    c = tqvec.TurboQuant(40, 3, "prod")
    np.testing.assert_array_equal(y, c.decode(c.encode(x), like=x))


def test_decode_writes_in_bounded_chunks(tmp_path, capsys, rng, monkeypatch):
    """A 1-bit sketch decodes to d floats per few bytes: ``tqvec decode`` never holds more
    than a chunk of the output (the codec is asked for chunk-sized slices only)."""
    import tqvec.cli as cli

    x = rng.standard_normal((300, 64)).astype(np.float32)
    c = tqvec.QJL(64, 1, seed=2)
    tqvec.save_codes(tmp_path / "q.tqc", c.encode(x))
    monkeypatch.setattr(cli, "DECODE_CHUNK_BYTES", 4 * 64 * 7)  # 7 rows a chunk
    sizes = []
    decode = tqvec.QJL.decode
    monkeypatch.setattr(tqvec.QJL, "decode",
                        lambda self, codes, **kw: sizes.append(len(codes)) or decode(self, codes,
                                                                                     **kw))
    assert main(["decode", str(tmp_path / "q.tqc"), str(tmp_path / "y.npy")]) == 0
    assert max(sizes) == 7 and sum(sizes) == 300
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), c.decode(c.encode(x), like=x))


def test_output_into_a_missing_folder_names_the_path(tmp_path, capsys, rng):
    np.save(tmp_path / "x.npy", rng.standard_normal((20, 32)).astype(np.float32))
    out = tmp_path / "nodir" / "x.tqc"
    assert main(["encode", str(tmp_path / "x.npy"), str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "does not exist" in err and ".tmp" not in err


@pytest.mark.parametrize("codec", ["qjl", "polarquant"])
def test_encode_other_codecs(tmp_path, codec, rng):
    np.save(tmp_path / "x.npy", rng.standard_normal((20, 32)).astype(np.float32))
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "x.tqc"), "--codec", codec,
                 "--level-bits", "3,2"]) == 0
    assert tqvec.load_codes(tmp_path / "x.tqc").params["codec"] == codec


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    np.save(tmp_path / "v.npy", np.ones(5, np.float32))
    assert main(["encode", str(tmp_path / "v.npy"), str(tmp_path / "o.tqc")]) == 2
    assert "input must hold a 2-D (n, d) array" in capsys.readouterr().err
    (tmp_path / "junk.tqc").write_bytes(b"hello")
    assert main(["decode", str(tmp_path / "junk.tqc"), str(tmp_path / "o.npy")]) == 2
    assert "not a tqvec file" in capsys.readouterr().err


def test_demo_runs_on_the_embedded_dataset(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert main(["demo", "--bits", "2", "--quiet", "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "TurboQuant mse b=2" in out and "1597 x 64" in out
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    tq = next(r for r in rows if r["method"] == "TurboQuant mse b=2")
    assert 0.08 < tq["rel_mse"] < 0.15 and tq["bytes_per_vector"] == 20


def test_bench_runs_on_the_embedded_dataset_and_writes_results(tmp_path, capsys):
    """`tqvec bench` (the README's first command) on digits: the default method rows, recall
    sane, results written where asked, a summary naming the recommended index."""
    pytest.importorskip("sklearn")
    pytest.importorskip("faiss")
    assert main(["bench", "--bits", "2", "--single", "2", "--min-time", "0.01", "--quiet",
                 "--threads", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "200 queries" in out and "faiss PQ32x4fs" in out and "PQ16x8" not in out
    assert "Summary for digits" in out and "2 bits/dim: " in out
    assert str(tmp_path / "search_digits.json") in out
    res = json.loads((tmp_path / "search_digits.json").read_text())
    assert res["complete"] and res["n"] == 1597 and res["nq"] == 200
    assert res["machine"]["cpus"] >= 1
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["faiss Flat"]["recall@10"] == 1.0
    assert rows["tqvec TQ2"]["bytes"] == 20
    assert 0.6 < rows["tqvec TQ2"]["recall@10"] < 0.8  # 0.705 at 20 bytes/vector
    assert rows["tqvec TQ2,Refine(TQ8g)"]["recall@10"] > 0.97
    assert rows["tqvec Center,TQ2f"]["recall@10"] > rows["tqvec TQ2"]["recall@10"]
    assert all(r["qps_single_1t"] > 0 and r["qps_batch_2t"] > 0 and r["qps_batch_1t"] > 0
               for r in res["rows"])
    md = (tmp_path / "search_digits.md").read_text()
    assert "200 queries" in md and "Summary for digits" in md


def test_bench_summary_compares_each_library_at_its_best_thread_setting():
    """faiss at 1 thread beat itself at 2 on digits (379,887 against 25,035 q/s): the summary's
    batch ratio takes each method's best measured setting and names it."""
    from tqvec.benchmark import summary

    row = {"bits": 4, "bytes": 36, "recall@10": 0.9, "build_s": 0.1}
    ours = dict(row, method="tqvec TQ4", qps_single_1t=50_000.0, qps_batch_1t=80_000.0,
                qps_batch_2t=90_000.0)
    faiss = dict(row, method="faiss PQ16x4fs", qps_single_1t=40_000.0, qps_batch_1t=380_000.0,
                 qps_batch_2t=25_000.0)
    text = summary({"dataset": "digits", "n": 1597, "d": 64, "metric": "l2",
                    "rows": [ours, faiss]}, 2)
    assert "0.24x its batch speed (380,000 q/s at 1t)" in text
    assert "90,000 batch q/s (2t)" in text and "best of 1 and 2 threads" in text


def test_bench_help_lists_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--dataset" in capsys.readouterr().out


def test_machine_info_names_the_cpu_generation():
    """Results name the CPU family and model: a VM's "AMD EPYC" alone hid a Zen 1 host (family
    23, model 1) that ran every benchmark ~2.5x slower than the Zen 3 of earlier runs."""
    from tqvec._machine import cpu_label, machine_info

    m = machine_info()
    assert m["cpus"] >= 1 and "tqvec" in m
    assert cpu_label({"cpu": "AMD EPYC", "cpu_family": 23, "cpu_model": 1}) == \
        "AMD EPYC (family 23, model 1)"
    assert cpu_label({"cpu": "X"}) == "X" and cpu_label({}) == "unknown CPU"
