"""Two runs' ops lined up by a sequence alignment, so that an op inserted or removed on one side moves nothing else.

Each op has a key of four parts: its *kind* (phase and op type), its *place* (the module scope), its *shape* (its
outputs' shapes; None where not known) and a coarse *value* (its statistics to 3 digits; None where not known).  Two
ops pair only when their kinds, and their shapes where both are known, are the same.  The alignment pairs ops in
order, the pairs scored by what else they share (the heaviest common subsequence): a pair scores 1, plus 2 for the
same place and 8 for the same value, so that a pair whose values agree outweighs two that agree on nothing else.
A compiled graph's ops (one scope: the compiled module) so pair with eager ones (each op in its own module) by type
and order, while ops of two eager runs pair by scope.  Where ops ran in another order (the gradients a compiled
backward hands over at its end), the ops whose values agree pair and the others are left unpaired, rather than
compared with the wrong op; at the end, ops left unpaired on both sides whose key and value are unique among those
left pair up, as the same op run elsewhere.

Order of work: the common head and tail of ops whose keys and values agree pair first; in between, runs of at least
three ops whose keys (value aside) agree (:class:`difflib.SequenceMatcher`'s matching blocks; where keys repeat too
much for it, ops whose key is unique on both sides amid such a run, in order: patience diff) pair and cut the rest
into gaps.  Each gap pairs its common head and tail, then is aligned by dynamic programming, a row of the table at a
time in numpy (Hirschberg's split keeps memory linear).  Two runs of one model that differ in a few ops so cost about
a linear pass; runs whose scopes differ everywhere (eager against compiled) cost the product of the gap's lengths (a
gap larger than :data:`_DP_CELLS` is cut into proportional pieces).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from difflib import SequenceMatcher
from typing import TypeVar

import numpy as np

__all__ = ["align"]

T = TypeVar("T")
Pair = tuple[int | None, int | None]
Key = tuple[Hashable, Hashable, Hashable, Hashable]  # (kind, place, shape, value)

_CACHE_BYTES = 64 << 20  # score rows a table row keeps for keys that come again
_TABLE_CELLS = 1 << 21  # a DP table this small is kept whole (16 MiB of int64); larger ones are split (Hirschberg)
_DP_CELLS = 1 << 31  # a gap larger than this is cut into proportional pieces
_BLOCK = 3  # ops in a row whose keys agree on both sides that pair before anything else
_REPEATS = 16  # keys matched per op, on average, below which SequenceMatcher finds the blocks in about linear time


class _Codes:
    """Each op's key parts as integers: kind, place, shape, and the whole key."""

    def __init__(self, keys: list[Key], ids: tuple[dict[Hashable, int], ...]) -> None:
        kinds, places, shapes, values, whole = ids
        self.kind = np.fromiter((kinds.setdefault(k[0], len(kinds)) for k in keys), np.int64, len(keys))
        self.place = np.fromiter((places.setdefault(k[1], len(places)) for k in keys), np.int64, len(keys))
        self.shape = np.fromiter((-1 if k[2] is None else shapes.setdefault(k[2], len(shapes)) for k in keys),
                                 np.int64, len(keys))
        self.value = np.fromiter((values.setdefault(k[3], len(values)) for k in keys), np.int64, len(keys))
        self.whole = [whole.setdefault(k[:3], len(whole)) for k in keys]
        self.known = [k[3] is not None for k in keys]


def _weights(ca: _Codes, i: int, cb: _Codes, b_lo: int, b_hi: int) -> np.ndarray:
    """The score of pairing A's op i with each of B's ops in ``[b_lo, b_hi)`` (0 across kinds)."""
    kind = cb.kind[b_lo:b_hi] == ca.kind[i]
    if ca.shape[i] >= 0:
        kind &= (cb.shape[b_lo:b_hi] == ca.shape[i]) | (cb.shape[b_lo:b_hi] < 0)
    place = cb.place[b_lo:b_hi] == ca.place[i]
    value = cb.value[b_lo:b_hi] == ca.value[i]
    weights: np.ndarray = kind * (1 + 2 * place + 8 * value)
    return weights


def _last_row(ca: _Codes, a_idx: range, cb: _Codes, b_lo: int, b_hi: int, reverse: bool) -> np.ndarray:
    """The last row of the score table of A's ops ``a_idx`` against B's ``[b_lo, b_hi)`` (both reversed when
    ``reverse``): entry k is the best score of the ops against B's first k (last k) ops.

    A row is the running maximum of ``max(above, above-left + score)``, as scores are never negative."""
    row = np.zeros(b_hi - b_lo + 1, dtype=np.int64)
    buf = np.empty(b_hi - b_lo, dtype=np.int64)
    cache: dict[tuple[int, int, int, int], np.ndarray] = {}
    room = _CACHE_BYTES // (8 * (b_hi - b_lo) + 8)  # score rows kept for keys that come again
    for i in (reversed(a_idx) if reverse else a_idx):
        code = (int(ca.kind[i]), int(ca.place[i]), int(ca.shape[i]), int(ca.value[i]))
        w = cache.get(code)
        if w is None:
            w = _weights(ca, i, cb, b_lo, b_hi)
            if reverse:
                w = w[::-1].copy()
            if len(cache) < room:
                cache[code] = w
        np.add(row[:-1], w, out=buf)
        np.maximum(buf, row[1:], out=buf)
        np.maximum.accumulate(buf, out=row[1:])
    return row


def _table_pairs(ca: _Codes, a_lo: int, a_hi: int, cb: _Codes, b_lo: int, b_hi: int) -> list[tuple[int, int]]:
    """The best pairs of a small gap, traced back through its whole table."""
    n, m = a_hi - a_lo, b_hi - b_lo
    table = np.zeros((n + 1, m + 1), dtype=np.int64)
    rows = [_weights(ca, a_lo + i, cb, b_lo, b_hi) for i in range(n)]
    for i in range(1, n + 1):
        np.maximum.accumulate(np.maximum(table[i - 1, 1:], table[i - 1, :-1] + rows[i - 1]), out=table[i, 1:])
    out = []
    i, j = n, m
    while i and j:
        w = int(rows[i - 1][j - 1])
        if w and table[i, j] == table[i - 1, j - 1] + w:
            out.append((a_lo + i - 1, b_lo + j - 1))
            i, j = i - 1, j - 1
        elif table[i - 1, j] >= table[i, j - 1]:
            i -= 1
        else:
            j -= 1
    out.reverse()
    return out


def _dp(ca: _Codes, a_lo: int, a_hi: int, cb: _Codes, b_lo: int, b_hi: int) -> list[tuple[int, int]]:
    """The best pairs of a gap, in memory linear in its lengths (Hirschberg)."""
    n, m = a_hi - a_lo, b_hi - b_lo
    if not n or not m:
        return []
    if n * m <= _TABLE_CELLS or n == 1:
        return _table_pairs(ca, a_lo, a_hi, cb, b_lo, b_hi)
    mid = a_lo + n // 2
    front = _last_row(ca, range(a_lo, mid), cb, b_lo, b_hi, reverse=False)
    back = _last_row(ca, range(mid, a_hi), cb, b_lo, b_hi, reverse=True)[::-1]
    k = b_lo + int(np.argmax(front + back))
    return _dp(ca, a_lo, mid, cb, b_lo, k) + _dp(ca, mid, a_hi, cb, k, b_hi)


def _gap(ca: _Codes, a_lo: int, a_hi: int, cb: _Codes, b_lo: int, b_hi: int) -> list[tuple[int, int]]:
    """The pairs of one gap between blocks: its common head and tail, then the best alignment of the rest.

    The head and tail pair ops whose keys agree, up to an op whose key is not unique in the gap and whose value
    differs: which of its kind it pairs with is for the alignment to say."""
    count_a, count_b = Counter(ca.whole[a_lo:a_hi]), Counter(cb.whole[b_lo:b_hi])

    def sure(i: int, j: int) -> bool:
        code = ca.whole[i]
        return code == cb.whole[j] and (ca.value[i] == cb.value[j] or count_a[code] == count_b[code] == 1)

    pairs = []
    while a_lo < a_hi and b_lo < b_hi and sure(a_lo, b_lo):
        pairs.append((a_lo, b_lo))
        a_lo, b_lo = a_lo + 1, b_lo + 1
    tail = []
    while a_lo < a_hi and b_lo < b_hi and sure(a_hi - 1, b_hi - 1):
        a_hi, b_hi = a_hi - 1, b_hi - 1
        tail.append((a_hi, b_hi))
    n, m = a_hi - a_lo, b_hi - b_lo
    if n and m:
        # rows of the table are the side with fewer distinct keys: their scores are computed once per key
        flip = len(set(zip(cb.whole[b_lo:b_hi], cb.value[b_lo:b_hi]))) < len(set(zip(ca.whole[a_lo:a_hi],
                                                                                        ca.value[a_lo:a_hi])))
        pieces = int(np.ceil(np.sqrt(-(-(n * m) // _DP_CELLS))))
        for p in range(pieces):  # proportional pieces where the gap is too large for one table
            lo_a, hi_a = a_lo + n * p // pieces, a_lo + n * (p + 1) // pieces
            lo_b, hi_b = b_lo + m * p // pieces, b_lo + m * (p + 1) // pieces
            if flip:
                pairs += [(i, j) for j, i in _dp(cb, lo_b, hi_b, ca, lo_a, hi_a)]
            else:
                pairs += _dp(ca, lo_a, hi_a, cb, lo_b, hi_b)
    return pairs + tail[::-1]


def _run(ka: list[int], i: int, kb: list[int], j: int) -> int:
    """How many keys in a row around A's i and B's j agree (i and j included), up to :data:`_BLOCK`."""
    length = 1
    while i - length >= 0 and j - length >= 0 and ka[i - length] == kb[j - length] and length < _BLOCK:
        length += 1
    ahead = 1
    while i + ahead < len(ka) and j + ahead < len(kb) and ka[i + ahead] == kb[j + ahead] and length < _BLOCK:
        length, ahead = length + 1, ahead + 1
    return length


def _unique_anchors(ka: list[int], kb: list[int]) -> list[tuple[int, int, int]]:
    """Keys that occur once on each side, amid a block of keys that agree, paired; the longest chain of them in
    the same order (patience diff).  For keys that repeat too much for :func:`_blocks`' SequenceMatcher."""
    count_a, count_b = Counter(ka), Counter(kb)
    where_b = {code: j for j, code in enumerate(kb) if count_b[code] == 1}
    candidates = [(i, where_b[code]) for i, code in enumerate(ka)
                  if count_a[code] == 1 and code in where_b and _run(ka, i, kb, where_b[code]) >= _BLOCK]
    tails: list[int] = []  # the longest increasing run of j, in O(k log k)
    tail_at: list[int] = []
    back: list[int] = []
    for n, (_, j) in enumerate(candidates):
        k = bisect.bisect_left(tails, j)
        if k == len(tails):
            tails.append(j)
            tail_at.append(n)
        else:
            tails[k], tail_at[k] = j, n
        back.append(tail_at[k - 1] if k else -1)
    out = []
    n = tail_at[-1] if tail_at else -1
    while n >= 0:
        out.append((*candidates[n], 1))
        n = back[n]
    return out[::-1]


def _blocks(ka: list[int], kb: list[int]) -> list[tuple[int, int, int]]:
    """Runs ``(i, j, size)`` of at least :data:`_BLOCK` keys that agree, in order: the matching blocks of
    :class:`difflib.SequenceMatcher` where keys repeat little, else unique anchors.  A lone op that agrees is no
    block (it may have run elsewhere: a gradient a compiled backward hands over at its end)."""
    count_b = Counter(kb)
    if sum(count_b.get(code, 0) for code in ka) > _REPEATS * (len(ka) + len(kb)):
        return _unique_anchors(ka, kb)  # SequenceMatcher's search would cost the square of the repeats
    matcher = SequenceMatcher(None, ka, kb, autojunk=False)
    return [(i, j, size) for i, j, size in matcher.get_matching_blocks() if size >= _BLOCK]


def _between(blocks: list[tuple[int, int, int]], a_lo: int, a_hi: int, b_lo: int,
             b_hi: int) -> list[tuple[int, int, int, int]]:
    """The gaps ``(a_lo, a_hi, b_lo, b_hi)`` that ``blocks`` (indices from the lows) leave with ops on both sides."""
    out = []
    i_at, j_at = a_lo, b_lo
    for i, j, size in [*blocks, (a_hi - a_lo, b_hi - b_lo, 0)]:
        if a_lo + i > i_at and b_lo + j > j_at:
            out.append((i_at, a_lo + i, j_at, b_lo + j))
        i_at, j_at = a_lo + i + size, b_lo + j + size
    return out


def _moved(ca: _Codes, cb: _Codes, match: dict[int, int]) -> dict[int, int]:
    """Ops left unpaired on both sides whose key and value (where known) are unique among those left on each side:
    the same op, run in another order."""
    used = set(match.values())
    left_a = [(ca.whole[i], int(ca.value[i])) for i in range(len(ca.whole)) if i not in match and ca.known[i]]
    left_b = {(cb.whole[j], int(cb.value[j])): j for j in range(len(cb.whole)) if j not in used and cb.known[j]}
    count_a = Counter(left_a)
    count_b = Counter((cb.whole[j], int(cb.value[j])) for j in range(len(cb.whole)) if j not in used and cb.known[j])
    out = {}
    for i in range(len(ca.whole)):
        if i in match or not ca.known[i]:
            continue
        key = (ca.whole[i], int(ca.value[i]))
        if count_a[key] == 1 and count_b.get(key) == 1:
            out[i] = left_b[key]
    return out


def align(items_a: Sequence[T], items_b: Sequence[T], key: Callable[[T], Key]) -> list[Pair]:
    """``(i, j)`` for A's item i paired with B's item j, ``(i, None)`` for an item only in A, ``(None, j)`` for one
    only in B.  In A's order, B's unpaired items before the pair that follows them; an item that ran in another order
    on B's side pairs where A ran it.  ``key(item)``: ``(kind, place, shape, value)``, the value None where it is not
    known."""
    ids: tuple[dict[Hashable, int], ...] = ({}, {}, {}, {}, {})
    ca, cb = _Codes([key(x) for x in items_a], ids), _Codes([key(x) for x in items_b], ids)
    match: dict[int, int] = {}
    # the common head and tail of ops whose keys and values agree; in the middle, blocks whose keys agree; then the
    # alignment of each gap they leave
    n, m = len(items_a), len(items_b)
    head = 0
    while head < n and head < m and ca.whole[head] == cb.whole[head] and ca.value[head] == cb.value[head]:
        match[head] = head
        head += 1
    tail = 0
    while (tail < n - head and tail < m - head and ca.whole[n - 1 - tail] == cb.whole[m - 1 - tail]
           and ca.value[n - 1 - tail] == cb.value[m - 1 - tail]):
        match[n - 1 - tail] = m - 1 - tail
        tail += 1
    a_lo, a_hi, b_lo, b_hi = head, n - tail, head, m - tail
    blocks = _blocks(ca.whole[a_lo:a_hi], cb.whole[b_lo:b_hi]) if a_hi > a_lo and b_hi > b_lo else []
    for i, j_block, size in blocks:
        match.update((a_lo + i + k, b_lo + j_block + k) for k in range(size))
    for gap in _between(blocks, a_lo, a_hi, b_lo, b_hi):
        match.update(_gap(ca, gap[0], gap[1], cb, gap[2], gap[3]))
    moved = _moved(ca, cb, match)
    moved_b = set(moved.values())
    pairs: list[Pair] = []
    j_at = 0
    for i in range(len(items_a)):
        j = match.get(i)
        if j is None:
            pairs.append((i, moved.get(i)))
            continue
        pairs.extend((None, k) for k in range(j_at, j) if k not in moved_b)
        pairs.append((i, j))
        j_at = j + 1
    pairs.extend((None, k) for k in range(j_at, len(items_b)) if k not in moved_b)
    return pairs
