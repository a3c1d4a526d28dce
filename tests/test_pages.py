"""tqvec.ops.pages: arrays on transparent huge pages where the system gives them."""

import mmap
import sys

import numpy as np
import pytest
import torch

from tqvec.ops import pages


@pytest.mark.parametrize("shape,dtype", [((0,), np.uint8), ((3, 5), np.float32),
                                         ((1 << 20, 3), np.int32), ((7, 3, 4, 32), np.uint8)])
def test_empty_is_a_writable_array_of_the_shape(shape, dtype):
    a = pages.empty(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    a[...] = 1
    assert int(a.sum()) == a.size


def test_large_arrays_are_aligned_huge_page_mappings():
    a = pages.empty((pages.MIN_BYTES // 4 + 3,), np.float32)
    small = pages.empty((10,), np.float32)
    assert not pages.on_huge_pages(small)
    if not pages._POSSIBLE:
        assert not pages.on_huge_pages(a)
        pytest.skip("no transparent huge pages here")
    assert pages.on_huge_pages(a)
    assert a.ctypes.data % pages.HUGE_PAGE == 0
    a[:] = 2.5
    view = a[5:].reshape(-1)
    del a  # the view keeps the mapping
    assert float(view[-1]) == 2.5


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="Linux only")
def test_a_refused_mapping_falls_back_to_the_heap(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no")
    monkeypatch.setattr(pages, "_POSSIBLE", True)
    monkeypatch.setattr(pages, "_huge_mapping", refuse)
    a = pages.empty((pages.MIN_BYTES,), np.uint8)
    assert a.shape == (pages.MIN_BYTES,) and not pages.on_huge_pages(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_host_cat_joins_rows(dtype):
    a = torch.arange(12).reshape(4, 3).to(dtype)
    b = torch.arange(12, 18).reshape(2, 3).to(dtype)
    out = pages.host_cat([a, b])
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, torch.cat([a, b]))
    big = pages.host_cat([torch.ones(pages.MIN_BYTES // 4, dtype=torch.float32)])
    assert (big.data_ptr() % pages.HUGE_PAGE == 0) == pages._POSSIBLE  # on its own mapping
    assert float(big.sum()) == pages.MIN_BYTES // 4
