"""The context-parallel split of a packed row (fsdptrain/data/context_split.py), worked out by hand."""

from __future__ import annotations

import pytest
import torch

from fsdptrain.data.context_split import Piece, chunk_bounds, padded_length, split_row


def test_head_and_tail_chunks():
    # T=16, cp=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_bounds(16, 2, 0) == ((0, 4), (12, 16))
    assert chunk_bounds(16, 2, 1) == ((4, 8), (8, 12))
    # causal work (sum of keys seen) is balanced: rank 0 sees 1+..+4 + 13+..+16, rank 1 5+..+12
    work = [sum(t + 1 for a, b in chunk_bounds(16, 2, r) for t in range(a, b)) for r in (0, 1)]
    assert work == [68, 68]


def test_row_length_must_split_into_equal_chunks():
    with pytest.raises(ValueError, match="cannot be split into 4 equal chunks for cp=2"):
        chunk_bounds(10, 2, 0)
    assert [padded_length(n, 2) for n in (0, 1, 4, 5, 8)] == [4, 4, 4, 8, 8]


def test_pieces_keep_segments_and_causality():
    # segments [0,3) [3,10) [10,12) of a row of 12, cp=2: chunks of 3; rank 0 holds [0,3) and [9,12)
    cu = torch.tensor([0, 3, 10, 12])
    split = split_row(cu, 12, cp_size=2, cp_rank=0)
    assert split.pieces == (Piece(0, 3, 0, 3), Piece(3, 4, 3, 10), Piece(4, 6, 10, 12))
    assert split.local_index().tolist() == [0, 1, 2, 9, 10, 11]
    # rank 1 holds [3,9): the middle segment's queries 3..8 see its keys from 3 up to themselves
    split = split_row(cu, 12, cp_size=2, cp_rank=1)
    assert split.pieces == (Piece(0, 3, 3, 6), Piece(3, 6, 3, 9))
    # position ids are taken from the row, never restarted per chunk
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]])
    assert split.take(positions).tolist() == [[0, 1, 2, 3, 4, 5]]
