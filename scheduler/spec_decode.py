"""n-gram (prompt lookup) drafts for speculative decoding: the tokens that followed the most recent earlier
occurrence of the sequence's longest matching suffix. Drafts cost nothing to make and are often right where the
output copies or edits its context (code, quotes, documents)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens: for n from ``max_n`` down to ``min_n``, the last n tokens are searched among all
    earlier windows of n tokens (one vectorized comparison per n); the most recent match wins, and the tokens that
    followed it are the draft. Empty when no suffix of at least ``min_n`` tokens occurred before."""
    if k < 1 or len(token_ids) < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows start at 0 .. length - n - 1: each is followed by at least one token, and none is the suffix.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start: start + k].tolist()
    return []
