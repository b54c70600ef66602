"""The first collective of each group where the ranks of a job disagree, as PyTorch's Flight Recorder analyzer finds
it: one never reached it, or ran a different op, size or dtype.  Pure: each rank's
:class:`recorder.rank_records.RankCollectives` in, :class:`Mismatch` out.

The ranks' sequence numbers and signatures are compared as arrays, group by group (a collective every member ran
with one signature is settled without a record); only the sequence numbers where they differ are looked at one by
one, in order, until the first that is a mismatch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from recorder.rank_records import CollectiveRecord, Descriptions, GroupRecords, RankCollectives

__all__ = ["Mismatch", "mismatches"]

_SEND, _RECV = frozenset({"send", "isend"}), frozenset({"recv", "irecv"})


@dataclass(frozen=True)
class Mismatch:
    """The first collective of a group where its ranks disagree."""

    group: str
    seq: int
    kind: str  #: missing | op | size | dtype
    expected: str  #: what the majority ran
    sides: dict[str, list[int]]  #: what each side ran ("never reached it" for missing ranks) → its ranks
    culprits: list[int]
    step: int
    t: int
    detail: str


def mismatches(ranks: dict[int, RankCollectives], descs: Descriptions, world: int, made: dict[int, int],
               steps: dict[int, int | None]) -> list[Mismatch]:
    """The first mismatch of each group (oldest first).  ``made``: when each rank's bundle was taken (a rank that
    went on after a snapshot is not missing from collectives begun after it); ``steps``: each rank's step then."""
    found = []
    for group in sorted({g for rc in ranks.values() for g in rc.groups}):
        per = {r: rc.groups[group] for r, rc in ranks.items() if group in rc.groups}
        members = [r for r in _members(group, per, descs, world) if r in ranks]
        if len(members) < 2:
            continue
        mine = [per[r] for r in members if r in per]
        if not mine:
            continue
        # a ring keeps only its newest collectives: compare from where every member's record starts
        lo = max([int(g.seq[0]) for g in mine] + ([1] if len(mine) < len(members) else []))
        hi = max(int(g.seq[-1]) for g in mine)
        seqs = np.concatenate([g.seq[(g.seq >= lo) & (g.seq <= hi)] for g in mine])
        sigs = np.concatenate([g.sig[(g.seq >= lo) & (g.seq <= hi)] for g in mine])
        if not len(seqs):
            continue
        order = np.argsort(seqs, kind="stable")
        seqs, sigs = seqs[order], sigs[order]
        unique, start, count = np.unique(seqs, return_index=True, return_counts=True)
        differ = (count < len(members)) | (np.minimum.reduceat(sigs, start) != np.maximum.reduceat(sigs, start))
        for seq in unique[differ].tolist():
            here = {r: _record(per.get(r), seq, descs) for r in members}
            newest = {r: int(per[r].seq[-1]) if r in per else 0 for r in members}
            mismatch = _compare(group, seq, here, newest, made, steps)
            if mismatch is not None:
                found.append(mismatch)
                break
    found.sort(key=lambda m: m.t)
    return found


def _record(records: GroupRecords | None, seq: int, descs: Descriptions) -> CollectiveRecord | None:
    at = records.at(seq) if records is not None else None
    return records.record(at, descs) if records is not None and at is not None else None


def _members(group: str, per: dict[int, GroupRecords], descs: Descriptions, world: int) -> list[int]:
    if ":p2p:" in group:
        pair = group.rsplit(":", 1)[1]
        if "-" in pair:
            lo, hi = pair.split("-", 1)
            if lo.isdigit() and hi.isdigit():
                return sorted({int(lo), int(hi)})
        return sorted(per)
    for records in per.values():
        listed = descs.fields[int(records.desc[0])].get("ranks")
        if listed:
            return sorted(listed)
    return list(range(world)) if group == "default" else sorted(per)


def _compare(group: str, seq: int, here: dict[int, CollectiveRecord | None], newest: dict[int, int],
             made: dict[int, int], steps: dict[int, int | None]) -> Mismatch | None:
    present = {r: rec for r, rec in here.items() if rec is not None}
    if not present:
        return None
    first = min(present.values(), key=lambda rec: rec.t)
    # a rank without a record of it went past it all the same when it recorded a later one of the group or reached a
    # later step (a ring recovered after a kill holds no collective PyTorch issued from C++: DDP's buckets)
    missing = sorted(r for r, rec in here.items() if rec is None and made.get(r, 0) > first.t
                     and not (newest[r] > seq or _later(steps.get(r), first.step)))
    if missing:
        sides = {first.describe(): sorted(present), "never reached it": missing}
        return Mismatch(group, seq, "missing", first.describe(), sides, missing, first.step, first.t,
                        f"rank(s) {_ranks(missing)} never reached {group} collective #{seq} ({first.op}), "
                        f"which rank(s) {_ranks(sorted(present))} entered")
    if len(present) < 2:
        return None
    by_sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r, rec in sorted(present.items()):
        by_sig[rec.signature()].append(r)
    if len(by_sig) == 1:
        return None
    ordered = sorted(by_sig.values(), key=lambda rs: (-len(rs), rs[0]))
    majority = ordered[0]
    expected = present[majority[0]]
    sides = {present[rs[0]].describe(): rs for rs in ordered}
    culprits = sorted(r for rs in ordered[1:] for r in rs) if len(majority) > len(ordered[1]) else \
        sorted(present)
    odd = present[ordered[1][0]]
    kind = "op" if odd.op != expected.op and not ({odd.op, expected.op} <= _SEND | _RECV) else \
        "size" if odd.sizes != expected.sizes else "dtype"
    detail = "; ".join(f"rank(s) {_ranks(rs)} ran {present[rs[0]].describe()}" for rs in ordered)
    return Mismatch(group, seq, kind, expected.describe(), sides, culprits, expected.step, first.t,
                    f"{group} collective #{seq}: {kind} differs: {detail}")


def _later(step: int | None, than: int) -> bool:
    return step is not None and step > than


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)
