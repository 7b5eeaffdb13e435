"""Batch helpers shared by the tests and the worker scripts they start (importable without torch)."""

import numpy as np


def right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids as one right-padded int32 [B, T] array (padding 0) and its attention mask."""
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return ids, mask
