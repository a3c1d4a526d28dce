"""Hostile input, part 2: mapped files that change under a reader, writers that fail or are
killed, paths that are not regular files, and the CLI (part 1: tests/test_hostile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tqvec
from tests.test_hostile import run_isolated
from tqvec import FormatError
from tqvec.cli import main
from tqvec.io import read_container, temp_name, write_container

# -- 3. mmap, honestly ---------------------------------------------------------------------

@pytest.fixture
def mapped_index(tmp_path, rng):
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    index = tqvec.index_factory(32, "TQ4", "l2")
    index.add(x)
    tqvec.write_index(index, tmp_path / "m.tqv")
    return tmp_path / "m.tqv", x


def test_truncating_a_mapped_file_is_detected_not_a_crash(mapped_index):
    path, x = mapped_index
    out = run_isolated(f"""
        import numpy as np, os, tqvec
        x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
        index = tqvec.read_index({str(path)!r}, mmap=True)
        index.search(x, 5)
        os.truncate({str(path)!r}, 4096)
        for f in (lambda: index.search(x, 5), lambda: index.reconstruct(3),
                  lambda: index.range_search(x, 1.0)):
            try:
                f()
                raise SystemExit("no error")
            except tqvec.FormatError as e:
                assert "modified while memory-mapped" in str(e), e
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode,
                                                                out.stderr[-2000:])


def test_rewriting_a_mapped_file_in_place_is_detected(mapped_index):
    path, x = mapped_index
    index = tqvec.read_index(path, mmap=True)
    index.search(x[:2], 5)
    st = os.stat(path)
    with open(path, "r+b") as f:  # another program rewrites the ids in place
        f.seek(st.st_size - 100)
        f.write(os.urandom(100))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(FormatError, match="modified while memory-mapped"):
        index.search(x[:2], 5)


def test_replacing_a_mapped_file_by_rename_is_fine(mapped_index, rng):
    """tqvec's writers rename a new file over the old one: a mapping of the old one stays
    valid and searches on."""
    path, x = mapped_index
    index = tqvec.read_index(path, mmap=True)
    D, I = index.search(x[:3], 5)
    other = tqvec.index_factory(32, "TQ2", "l2")
    other.add(rng.standard_normal((100, 32)).astype(np.float32))
    tqvec.write_index(other, path)
    D2, I2 = index.search(x[:3], 5)
    np.testing.assert_array_equal(I, I2)
    assert tqvec.read_index(path).ntotal == 100


def test_mapped_codes_check_their_file_at_each_use(codes_file):
    codes = tqvec.load_codes(codes_file, mmap=True)
    c = tqvec.codec_from_params(codes.params)
    c.decode(codes[:10])
    os.truncate(codes_file, 1000)
    with pytest.raises(FormatError, match="modified while memory-mapped"):
        c.decode(codes[:10])


def test_stale_temporaries_are_removed_by_the_next_write(tmp_path, rng):
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(rng.standard_normal((50, 16)).astype(np.float32))
    old = tmp_path / temp_name()                  # a killed writer's: unlocked, old
    fresh = tmp_path / temp_name()                # just created: maybe a writer starting
    live = tmp_path / temp_name()                 # old but locked: a live writer's
    other = tmp_path / "mine.tmp"                 # not ours
    users = tmp_path / ".tqvec-notes.tmp"         # not a name a writer makes: the user's
    name = temp_name()
    forged = tmp_path / (name[:-5] + "01"[name[-5] == "0"] + ".tmp")  # a tag that does not match
    for f in (old, fresh, live, other, users, forged):
        f.write_bytes(b"x" * 1000)
    hour_ago = time.time() - 3600
    for f in (old, live, other, users, forged):
        os.utime(f, (hour_ago, hour_ago))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(live)!r}, "rb")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        tqvec.write_index(index, tmp_path / "i.tqv")
    finally:
        holder.kill()
        holder.wait()
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"i.tqv", fresh.name, live.name, other.name, users.name, forged.name}


def test_a_writer_killed_mid_write_leaves_the_old_file_and_a_temporary_the_next_write_removes(
        tmp_path, rng):
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(rng.standard_normal((50, 16)).astype(np.float32))
    tqvec.write_index(index, tmp_path / "i.tqv")
    old = (tmp_path / "i.tqv").read_bytes()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, tqvec.io
        def write(f):
            f.write(b"half a file" * 1000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
        tqvec.io.atomic_write({str(tmp_path / "i.tqv")!r}, write)
    """)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".tqvec-")]
    assert len(temps) == 1 and (tmp_path / "i.tqv").read_bytes() == old
    hour_ago = time.time() - 3600  # the next write comes later
    os.utime(temps[0], (hour_ago, hour_ago))
    tqvec.write_index(index, tmp_path / "j.tqv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.tqv", "j.tqv"]


def test_a_failed_write_leaves_no_temporary(tmp_path):
    class Boom(Exception):
        pass

    def write(f):
        f.write(b"partial")
        raise Boom
    with pytest.raises(Boom):
        tqvec.io.atomic_write(tmp_path / "x.bin", write)
    assert list(tmp_path.iterdir()) == []


def test_writers_never_write_through_a_symlink_or_onto_a_device(tmp_path, codes_file):
    codes = tqvec.load_codes(codes_file)
    target = tmp_path / "target.tqc"
    target.write_bytes(b"precious")
    link = tmp_path / "link.tqc"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="is a symlink"):
        tqvec.save_codes(link, codes)
    assert target.read_bytes() == b"precious" and link.is_symlink()
    fifo = tmp_path / "pipe.tqc"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        tqvec.save_codes(fifo, codes)
    assert fifo.is_fifo()




# -- 6. CLI --------------------------------------------------------------------------------

def test_cli_refuses_archives_and_non_arrays(tmp_path, capsys):
    np.savez(tmp_path / "x.npz", a=np.ones((3, 8), np.float32))
    assert main(["encode", str(tmp_path / "x.npz"), str(tmp_path / "o.tqc")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "got an archive" in err
    (tmp_path / "t.npy").write_text("not an array")
    assert main(["encode", str(tmp_path / "t.npy"), str(tmp_path / "o.tqc")]) == 2
    assert "must be a .npy file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npy", "x.npz"]


def test_cli_never_writes_through_a_symlink_or_onto_a_non_regular_file(tmp_path, capsys, rng):
    np.save(tmp_path / "x.npy", rng.standard_normal((20, 8)).astype(np.float32))
    (tmp_path / "keep").write_bytes(b"precious")
    (tmp_path / "link.tqc").symlink_to(tmp_path / "keep")
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "link.tqc")]) == 2
    assert "is a symlink" in capsys.readouterr().err
    assert (tmp_path / "keep").read_bytes() == b"precious" and (tmp_path / "link.tqc").is_symlink()
    os.mkfifo(tmp_path / "pipe")
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "pipe")]) == 2
    assert (tmp_path / "pipe").is_fifo()
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "c.tqc")]) == 0
    (tmp_path / "adir").mkdir()
    assert main(["decode", str(tmp_path / "c.tqc"), str(tmp_path / "adir")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_cli_never_eats_its_input(tmp_path, rng):
    x = rng.standard_normal((20, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "x.npy")]) == 2
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), x)
    assert main(["encode", str(tmp_path / "x.npy"), str(tmp_path / "c.tqc")]) == 0
    data = (tmp_path / "c.tqc").read_bytes()
    assert main(["decode", str(tmp_path / "c.tqc"), str(tmp_path / "c.tqc")]) == 2
    assert (tmp_path / "c.tqc").read_bytes() == data


def test_containers_refuse_what_write_container_never_writes(tmp_path):
    """A hand-made container: NaN in the header, an empty kind and a bad layout."""
    with pytest.raises(ValueError):
        write_container(tmp_path / "n.tqc", "codes", {"x": float("nan")}, {})
    write_container(tmp_path / "e.tqc", "codes", {}, {})
    assert read_container(tmp_path / "e.tqc", "codes").arrays == {}


def test_writes_never_change_the_process_umask(tmp_path, rng, monkeypatch):
    """The temporary gets open()'s mode from the kernel; os.umask (process-wide: another thread
    creating a file meanwhile would get mode 0666) is never called."""
    def no_umask(*a):
        raise AssertionError("os.umask changes the mode of every thread's new files")
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(rng.standard_normal((50, 16)).astype(np.float32))
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        tqvec.write_index(index, tmp_path / "i.tqv")
        tqvec.save_codes(tmp_path / "c.tqc", index.codec.encode(np.zeros((2, 16), np.float32)))
        pytest.importorskip("h5py")
        from tqvec.datasets import write_hdf5
        write_hdf5(str(tmp_path / "a.hdf5"), np.ones((20, 4), np.float32),
                   np.ones((2, 4), np.float32), "euclidean", k=5)
    finally:
        monkeypatch.undo()
        os.umask(old)
    for name in ("i.tqv", "c.tqc", "a.hdf5"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name


def test_paths_as_bytes_and_missing_folders(tmp_path, rng):
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(rng.standard_normal((50, 16)).astype(np.float32))
    target = os.fsencode(tmp_path / "i.tqv")
    tqvec.write_index(index, target)
    back = tqvec.read_index(target)
    assert back.ntotal == 50
    missing = tmp_path / "nodir" / "i.tqv"
    with pytest.raises(FileNotFoundError, match="nodir.*does not exist") as e:
        tqvec.write_index(index, missing)
    assert str(missing) in str(e.value) and ".tqvec-" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="nodir"):
        tqvec.save_codes(missing, index.codec.encode(np.zeros((1, 16), np.float32)))
