"""n-gram (prompt lookup) drafts for speculative decoding: the tokens that followed the most recent earlier
occurrence of the sequence's longest matching suffix. Drafts cost nothing to make and are often right where the
output copies or edits its context (code, quotes, documents)."""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens: the longest suffix of ``min_n`` to ``max_n`` tokens that occurred before (ending
    before the last token); of its occurrences the most recent wins, and the tokens that followed it are the draft.
    Empty when no suffix of at least ``min_n`` tokens occurred before.

    Vectorized over the candidates, the earlier positions holding the last token: each is extended backwards one
    comparison per n, so a step costs one pass over the tokens plus max_n small ones."""
    length = len(token_ids)
    if k < 1 or min_n < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])  # each is followed by at least one token
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched at each candidate, up to max_n
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        prev = ends - j
        alive &= prev >= 0
        alive[alive] = tokens[prev[alive]] == tokens[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(matched >= best)[-1]]) + 1
    return tokens[start: start + k].tolist()
