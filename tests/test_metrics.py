"""The benchmark's recall metrics on hand-computed cases (the README's tables come from them)."""

import numpy as np
import pytest

from tqvec.benchmark import recall, recall_1_at_10


def _case():
    # 3 queries; ground truth best first. Query 0 finds its nearest neighbour (7) at rank 6 and
    # 4 of its true top 10; query 1 misses its nearest neighbour but finds 9 of the top 10;
    # query 2 finds everything, in another order.
    gt = np.array([[7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11],
                   [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                   [5, 4, 3, 2, 1, 0, 9, 8, 7, 6, 12]])
    I = np.array([[20, 21, 1, 2, 22, 23, 7, 24, 25, 3, -1],
                  [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0],
                  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12]])
    return I, gt


def test_recall_at_10_by_hand():
    I, gt = _case()
    # |I[:10] & gt[:10]| / 10: query 0 {7, 1, 2, 3}; query 1 {1..9}; query 2 all ten
    assert recall(I, gt, 10) == pytest.approx((4 / 10 + 9 / 10 + 10 / 10) / 3)
    assert recall(I, gt, 1) == pytest.approx((0 + 0 + 0) / 3)  # no rank-1 hit equals gt[0]


def test_recall_1_at_10_by_hand():
    """The true nearest neighbour anywhere in the top 10: queries 0 and 2, not 1 (its nearest
    neighbour, 0, is 11th)."""
    I, gt = _case()
    assert recall_1_at_10(I, gt) == pytest.approx(2 / 3)
    assert recall_1_at_10(I[:, :10], gt) == pytest.approx(2 / 3)  # only the top 10 counts
