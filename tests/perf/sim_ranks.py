"""Simulated training ranks for the job doctor's scale benchmark (bench_doctor.py): N ranks' RDR files, written
with the real ring writer.

Run: python tests/perf/sim_ranks.py ROOT --ranks 16 [--bundles] [--hold] [--check]
(``--hold`` keeps the rings open, as a running job does, until Enter: try ``obs top ROOT`` meanwhile.)

Each rank's ring is a :class:`recorder.ring.RingWriter` with the default capacities (~13.9 MiB a rank, as
a user's job has), filled as a training rank at granularity ``module`` fills it:

* per step: STEP_BEGIN, PHASE data / forward / backward / optimizer (``a``, ``b``, ``c``, ``d`` as
  ``Recorder._subscribe`` writes them), MODULE_ENTER / MODULE_EXIT of a 20-module model (MindSpore scopes, as
  ``obs.runtime.torch._modules`` names them), 8 gradient-bucket ``all_reduce`` in group ``default`` (a
  ``started`` slot at entry, a ``completed`` slot with its duration at the end), STEP_END, MEMORY;
* the collectives are blocking and every member leaves one together, when its last member arrived;
* one slow rank (rank 7, or the last one) takes +50 ms in data loading at every step: the others wait for it in
  the step's first all_reduce;
* enough steps to wrap the module ring once, so every ring is full, as in a long job (the step and collective
  rings wrap several times; the memory ring holds one slot a step);
* no blobs (prints, settings changes, markers): a quiet job's;
* times in ``time.perf_counter_ns()`` units, one clock for every rank (hosts named ``sim-node-NNN``, 8 ranks a
  host); the live picture ends mid-step: every rank but the slow one waits in the step's first all_reduce, the
  slow one is still loading data.

Slots are written straight into the writer's map with numpy (``SLOT_DTYPE``, the reader's view of the writer's
``SLOT`` struct), at the positions and with the ``seq`` and ``idx`` the writer's appender would give them
(:func:`check_format` compares both ways byte for byte); the header, the string table (``RingWriter.intern``) and
the regions are the writer's own.  Each rank's header carries a fake pid (``ring_{pid}.obsring``); the rings stay
locked (``flock``: alive to ``obs top``) while the :class:`SimJob` holds them open.  :meth:`SimJob.dump` writes
each rank's bundle from its ring as ``Recorder.dump`` does (``read_ring``, ``bundle_parts``, ``write_bundle``),
and its ``marker.json`` as ``Recorder.mark`` does.  The slots, bundles and markers are written by forked workers
(one per core) through the maps they inherit; 512 ranks take about 20 s for the rings and 60 s for the bundles on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from obs._core import safe_files
from recorder.assemble import bundle_parts
from recorder.bundle import bundle_name, write_bundle
from recorder.collective_desc import collective_desc
from recorder.layout import DEFAULT_CAPACITY, PHASE_CODES, Kind
from recorder.recorder import rdr_dir
from recorder.ring import RingWriter
from recorder.ring_reader import SLOT_DTYPE, read_ring

__all__ = ["SimConfig", "SimJob", "check_format", "module_scopes"]

MS = 1_000_000  # ns
US = 1_000
PID_BASE = 200_000  # rank r's fake pid: PID_BASE + r
RINGS = ("step", "module", "collective", "memory")  # the rings a rank at granularity module fills (no op slots)
_STEP, _MODULE, _COLLECTIVE, _MEMORY = range(4)
#: one event of a rank: the ring it goes to, then a slot's fields (seq and idx are given at write time)
EVENT = np.dtype([("t", "<i8"), ("ring", "u1"), ("kind", "<u2"), ("flags", "<u2"), ("a", "<i4"), ("b", "<i8"),
                  ("c", "<i8"), ("d", "<i8")])
#: what a bundle's manifest carries of the settings (a user's rdr section)
SETTINGS = {"rdr": {"enable": True, "mode": 2, "granularity": "module"}}
#: the threads' stacks a bundle carries (``recorder.stacks.all_stacks``' form): the main thread at the end of a loop
THREADS = [{"thread": "MainThread", "ident": 1, "daemon": False, "main": True, "frames": [
    {"file": "train.py", "line": 88, "function": "<module>", "code": "main()"},
    {"file": "train.py", "line": 80, "function": "main", "code": "for batch in obs.steps(loader):"}]}]


def module_scopes(blocks: int = 3) -> list[tuple[bool, str]]:
    """One forward's module calls, as (enter?, scope) in order: a 19-module net (embedding, ``blocks`` blocks of
    norm, attention, norm, MLP, a final norm and head) and its loss, 20 modules (40 slots)."""
    out: list[tuple[bool, str]] = []

    def call(scope: str, inner: list[str] | None = None) -> None:
        out.append((True, scope))
        for child in inner or ():
            call(scope + "/" + child)
        out.append((False, scope))

    net = "Default/net-Net"
    out.append((True, net))
    call(net + "/embed-Embedding")
    for i in range(blocks):
        call(f"{net}/block{i}-Block", ["norm1-LayerNorm", "attn-Attention", "norm2-LayerNorm", "mlp-MLP"])
    call(net + "/norm-LayerNorm")
    call(net + "/head-Linear")
    out.append((False, net))
    call("Default/net-CrossEntropyLoss")
    return out


@dataclass(frozen=True)
class SimConfig:
    ranks: int
    steps: int = 0  #: 0: enough to wrap the module ring once (plus one step)
    slow_rank: int = 7  #: taken as the last rank in a job of 7 ranks or fewer
    slow_data_ms: float = 50.0
    buckets: int = 8
    ranks_per_host: int = 8
    seed: int = 0
    run_id: str = "sim0doctor0000"
    capacity: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))

    @property
    def slow(self) -> int:
        return self.slow_rank if self.slow_rank < self.ranks else self.ranks - 1

    def step_count(self) -> int:
        if self.steps:
            return self.steps
        return self.capacity["module"] // len(module_scopes()) + 2


class Timeline:
    """When every rank does what, for every step (ns of the simulation's clock; 0 is the first step's data)."""

    def __init__(self, config: SimConfig) -> None:
        rng = np.random.default_rng(config.seed)
        ranks, steps, buckets = config.ranks, config.step_count(), config.buckets

        def jitter(mean_ms: float, sd_ms: float, shape: tuple[int, ...]) -> np.ndarray:
            values = rng.normal(mean_ms * MS, sd_ms * MS, shape)
            return np.maximum(values, 0.1 * mean_ms * MS).astype(np.int64)

        data = jitter(5.0, 0.2, (ranks, steps))
        data[config.slow] += int(config.slow_data_ms * MS)
        forward = jitter(30.0, 0.3, (ranks, steps))
        chunks = jitter(5.0, 0.2, (ranks, steps, buckets))  # backward's work before each bucket is ready
        comm = jitter(1.5, 0.05, (steps, buckets))  # the all_reduce itself, once the last member is in
        optimizer = jitter(4.0, 0.1, (ranks, steps))
        gap = jitter(0.3, 0.02, (ranks, steps))  # the loop's own code between a step's end and the next data
        self.data_begin = np.empty((ranks, steps), np.int64)
        self.begin = np.empty((ranks, steps), np.int64)
        self.forward_end = np.empty((ranks, steps), np.int64)
        self.enter = np.empty((ranks, steps, buckets), np.int64)
        self.leave = np.empty((steps, buckets), np.int64)
        self.optimizer_end = np.empty((ranks, steps), np.int64)
        self.end = np.empty((ranks, steps), np.int64)
        at = np.zeros(ranks, np.int64)
        for s in range(steps):
            self.data_begin[:, s] = at
            self.begin[:, s] = at + data[:, s]
            self.forward_end[:, s] = self.begin[:, s] + forward[:, s]
            ready = self.forward_end[:, s]
            for k in range(buckets):
                self.enter[:, s, k] = ready + chunks[:, s, k]
                self.leave[s, k] = int(self.enter[:, s, k].max()) + int(comm[s, k])  # all leave when the last came
                ready = np.full(ranks, self.leave[s, k], np.int64)
            self.optimizer_end[:, s] = self.leave[s, -1] + 5 * US + optimizer[:, s]
            self.end[:, s] = self.optimizer_end[:, s] + 10 * US
            at = self.end[:, s] + gap[:, s]
        others = np.arange(ranks) != config.slow
        #: the live picture: the last step's first all_reduce, every rank but the slow one in it
        self.cut = int(self.enter[others, -1, 0].max() if others.any() else self.begin[:, -1].max()) + 500 * US
        self.steps, self.buckets = steps, buckets
        self.memory = rng.integers(30 << 30, 31 << 30, (ranks, steps))


def rank_events(tl: Timeline, rank: int, scope_ids: list[int], desc_ids: list[int], device_id: int) -> np.ndarray:
    """Every event of ``rank`` over the whole run, in the order they happen (its ``seq`` order)."""
    steps, buckets = tl.steps, tl.buckets
    scopes = module_scopes()
    per_step = 2 + len(scopes) + 1 + 2 * buckets + 4
    ev = np.zeros((steps, per_step), EVENT)
    number = np.arange(1, steps + 1, dtype=np.int64)
    begin, fwd_end = tl.begin[rank], tl.forward_end[rank]
    col = 0

    def put(t: Any, ring: int, kind: int, a: Any = 0, b: Any = 0, c: Any = 0, d: Any = 0, flags: int = 0) -> None:
        nonlocal col
        row = ev[:, col]
        row["t"], row["ring"], row["kind"], row["flags"] = t, ring, kind, flags
        row["a"], row["b"], row["c"], row["d"] = a, b, c, d
        col += 1

    put(begin, _STEP, Kind.STEP_BEGIN, 0, number)
    put(begin + US, _STEP, Kind.PHASE, PHASE_CODES["data"], number, tl.data_begin[rank], begin)
    span = fwd_end - begin
    for i, (opens, _scope) in enumerate(scopes):
        put(begin + 2 * US + span * (2 * i + 1) // (2 * len(scopes) + 2), _MODULE,
            Kind.MODULE_ENTER if opens else Kind.MODULE_EXIT, scope_ids[i], number)
    put(fwd_end + US, _STEP, Kind.PHASE, PHASE_CODES["forward"], number, begin, fwd_end)
    for k in range(buckets):
        seq = (number - 1) * buckets + k + 1
        enter, leave = tl.enter[rank, :, k], tl.leave[:, k]
        put(enter, _COLLECTIVE, Kind.COLLECTIVE, desc_ids[k], seq, 0, 1)  # started (a blocking call)
        put(leave, _COLLECTIVE, Kind.COLLECTIVE, desc_ids[k], seq, leave - enter, 2)  # completed, its duration
    last = tl.leave[:, -1]
    put(last + US, _STEP, Kind.PHASE, PHASE_CODES["backward"], number, fwd_end, last)
    put(tl.optimizer_end[rank] + US, _STEP, Kind.PHASE, PHASE_CODES["optimizer"], number, last + 5 * US,
        tl.optimizer_end[rank])
    put(tl.end[rank], _STEP, Kind.STEP_END, 0, number, tl.end[rank] - begin)
    put(tl.end[rank] + 20 * US, _MEMORY, Kind.MEMORY, device_id, number, tl.memory[rank], tl.memory[rank] + (8 << 30))
    flat = ev.reshape(-1)
    return flat[np.argsort(flat["t"], kind="stable")]


def write_slots(writer: RingWriter, events: np.ndarray, upto: int, offset: int) -> None:
    """The slots the writer's appenders leave after appending ``events[:upto]`` (seq 1, 2, ... in order; the
    ``idx`` of each ring counted from 0), written into its map; times (``t``, a phase's begin and end) moved by
    ``offset``."""
    mm = writer.buffer()
    seqs = np.arange(1, len(events) + 1, dtype=np.uint64)
    for code, name in enumerate(RINGS):
        mine = np.nonzero(events["ring"][:upto] == code)[0]
        region = writer.rings[name]
        keep = mine[-region.capacity:]  # the newest capacity slots: the rest were overwritten
        idx = np.arange(len(mine) - len(keep), len(mine), dtype=np.uint64)
        slots = np.zeros(len(keep), SLOT_DTYPE)
        part = events[keep]
        slots["seq"], slots["idx"], slots["t"] = seqs[keep], idx + 1, part["t"] + offset
        for f in ("kind", "flags", "a", "b", "c", "d"):
            slots[f] = part[f]
        phase = part["kind"] == Kind.PHASE  # its c and d are times (begin, end) too
        slots["c"][phase] += offset
        slots["d"][phase] += offset
        view = np.frombuffer(mm, SLOT_DTYPE, region.capacity, region.offset)
        view[(idx % region.capacity).astype(np.int64)] = slots


def check_format(folder: str) -> None:
    """The numpy path writes the bytes the writer's own slot target (``RingWriter.slots``, what ``appender`` packs
    through) writes, for a small ring that wraps: raises AssertionError otherwise."""
    config = SimConfig(ranks=2, steps=5, slow_rank=0, capacity={**DEFAULT_CAPACITY, "module": 96, "step": 8,
                                                                  "collective": 24, "memory": 4})
    tl = Timeline(config)
    rings = []
    for i in range(2):
        writer = RingWriter(os.path.join(folder, f"ring_{i}.obsring"), dict(config.capacity), pid=i, rank=0,
                            world_size=1, meta={})
        scope_ids = [writer.intern(s) for _e, s in module_scopes()]
        desc_ids = [writer.intern(d) for d in bucket_descs(config.buckets)]
        rings.append((writer, rank_events(tl, 0, scope_ids, desc_ids, writer.intern("cuda:0"))))
    (numpy_way, events), (slot_way, same) = rings
    assert np.array_equal(events, same)
    write_slots(numpy_way, events, len(events), 0)
    targets = {name: slot_way.slots(name) for name in RINGS}
    for seq, e in enumerate(events.tolist(), start=1):
        t, ring, kind, flags, a, b, c, d = e
        pack, mm, base, cap, size, counter, _seq, _clock = targets[RINGS[ring]]
        idx = next(counter)
        pack(mm, base + (idx % cap) * size, seq, idx + 1, t, kind, flags, a, b, c, d)
    for name in RINGS:
        region = numpy_way.rings[name]
        span = slice(region.offset, region.offset + region.capacity * SLOT_DTYPE.itemsize)
        assert numpy_way.buffer()[span] == slot_way.buffer()[span], f"ring {name}: the numpy slots differ"
    a, b = read_ring(numpy_way.buffer()), read_ring(slot_way.buffer())
    assert np.array_equal(a.slots, b.slots) and a.strings == b.strings
    for writer, _ev in rings:
        writer.close(remove=True)


def bucket_descs(buckets: int) -> list[str]:
    """The gradient buckets' all_reduce descriptions (25 MiB float32 buckets, the last one smaller)."""
    sizes = [6_553_600] * (buckets - 1) + [1_234_567]
    return [collective_desc({"op": "all_reduce", "group": "default", "dtype": "float32", "sizes": [[n]]})
            for n in sizes]


def _raise_file_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard == resource.RLIM_INFINITY else min(hard, need), hard))


class SimJob:
    """A simulated job under ``root``: :meth:`start` makes every rank's ring (open and locked, as a running job's),
    :meth:`finish` runs the last step to its end, :meth:`dump` writes the bundles and markers, :meth:`close`
    closes the rings (removing them: a normal end with a bundle).

    The rings are made and held by this process; the slots, bundles and markers are written by ``workers`` forked
    processes (default: one per core), through the maps they inherit (shared: the same pages)."""

    def __init__(self, root: str, config: SimConfig, *, workers: int | None = None) -> None:
        self.root, self.config = root, config
        self.workers = workers or len(os.sched_getaffinity(0))
        self.timeline = Timeline(config)
        # The live picture ends now: the simulation's clock is moved onto perf_counter_ns.
        self.offset = time.perf_counter_ns() - self.timeline.cut
        self.writers: list[RingWriter] = []
        self.ids: list[tuple[list[int], list[int], int]] = []  # per rank: scope, bucket and device string ids
        self.bundles: dict[int, str] = {}

    def dir(self, rank: int) -> str:
        return rdr_dir(self.root, rank)

    def pid(self, rank: int) -> int:
        return PID_BASE + rank

    def start(self) -> None:
        """Every rank's ring, filled up to now (the live picture), and its marker (``running``)."""
        config = self.config
        _raise_file_limit(config.ranks + 256)
        descs = bucket_descs(config.buckets)
        scopes = [s for _e, s in module_scopes()]
        for rank in range(config.ranks):
            folder = self.dir(rank)
            safe_files.ensure_dir(folder)
            host = f"sim-node-{rank // config.ranks_per_host:03d}"
            writer = RingWriter(os.path.join(folder, f"ring_{self.pid(rank)}.obsring"), dict(config.capacity),
                                pid=self.pid(rank), rank=rank, world_size=config.ranks,
                                meta={"run_id": config.run_id, "host": host, "granularity": "module",
                                      "argv": ["train.py"], "versions": {"obs": "sim"}})
            self.writers.append(writer)
            self.ids.append(([writer.intern(s) for s in scopes], [writer.intern(d) for d in descs],
                             writer.intern(f"cuda:{rank % config.ranks_per_host}")))
        self._each(_fill_live)

    def finish(self) -> None:
        """Every rank runs the last step to its end (the job ends normally)."""
        self._each(_fill_all)

    def dump(self, reason: str = "normal_end") -> None:
        """Each rank's bundle from its ring, as ``Recorder.dump`` writes it (without fsync), and its marker."""
        self.bundles = dict(enumerate(self._each(_dump, reason)))

    def close(self, *, remove: bool = True) -> None:
        """Close every ring: a rank's writer is gone (its lock free); ``remove`` as a clean end does."""
        for writer in self.writers:
            writer.close(remove=remove)
        self.writers = []

    def mark(self, rank: int, state: str, **extra: Any) -> None:
        """``marker.json`` as ``Recorder.mark`` writes it."""
        bundle = self.bundles.get(rank)
        data = {"state": state, "pid": self.pid(rank), "rank": rank, "world_size": self.config.ranks,
                "run_id": self.config.run_id, "dumps": [os.path.basename(bundle)] if bundle else [],
                "updated_ns": time.time_ns(), **extra}
        safe_files.write_atomic(os.path.join(self.dir(rank), "marker.json"), json.dumps(data, indent=2, default=str),
                                fsync=False)

    def events(self, rank: int) -> np.ndarray:
        scope_ids, desc_ids, device_id = self.ids[rank]
        return rank_events(self.timeline, rank, scope_ids, desc_ids, device_id)

    def _each(self, work: Callable[..., Any], *args: Any) -> list[Any]:
        """``work(job, rank, *args)`` for every rank, in the forked workers; the results by rank."""
        global _JOB
        ranks = range(self.config.ranks)
        if self.workers <= 1:
            return [work(self, rank, *args) for rank in ranks]
        _JOB = self
        try:
            with multiprocessing.get_context("fork").Pool(self.workers) as pool:
                return pool.starmap(_in_worker, [(work, rank, *args) for rank in ranks],
                                    chunksize=max(1, self.config.ranks // (8 * self.workers)))
        finally:
            _JOB = None


_JOB: SimJob | None = None  # the job a forked worker works on (inherited, never pickled)


def _in_worker(work: Callable[..., Any], rank: int, *args: Any) -> Any:
    assert _JOB is not None
    return work(_JOB, rank, *args)


def _fill_live(job: SimJob, rank: int) -> None:
    events = job.events(rank)
    write_slots(job.writers[rank], events, int(np.searchsorted(events["t"], job.timeline.cut, side="right")),
                job.offset)
    job.mark(rank, "running")


def _fill_all(job: SimJob, rank: int) -> None:
    events = job.events(rank)
    write_slots(job.writers[rank], events, len(events), job.offset)


def _dump(job: SimJob, rank: int, reason: str) -> str:
    contents = read_ring(job.writers[rank].buffer())
    manifest, files = bundle_parts(contents, reason, threads=THREADS, settings=SETTINGS)
    try:
        from recorder.now import now

        manifest["now"] = now(contents)
    except Exception:  # noqa: BLE001 - the bundle goes out without it, as Recorder._write's does
        pass
    path = write_bundle(job.dir(rank), bundle_name(reason, job.pid(rank)), manifest, files, fsync=False)
    job.bundles[rank] = path
    job.mark(rank, "dumped", last_reason=reason, last_bundle=os.path.basename(path))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the folder to write the job's files under (created)")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=0, help="steps (default: enough to wrap the module ring)")
    parser.add_argument("--bundles", action="store_true", help="end the job: bundles and markers, rings removed")
    parser.add_argument("--hold", action="store_true", help="keep the rings open (alive) until Enter")
    parser.add_argument("--check", action="store_true", help="compare the numpy slots with the writer's, and exit")
    args = parser.parse_args()
    if args.check:
        safe_files.ensure_dir(args.root)
        check_format(args.root)
        print("the numpy slots are the writer's, byte for byte")
        return 0
    job = SimJob(args.root, SimConfig(ranks=args.ranks, steps=args.steps))
    began = time.perf_counter()
    job.start()
    print(f"{args.ranks} rings written under {args.root} in {time.perf_counter() - began:.1f} s "
          f"({job.timeline.steps} steps; slow rank {job.config.slow})")
    if args.hold:
        input("rings open (alive): press Enter to end the job ")
    if args.bundles:
        began = time.perf_counter()
        job.finish()
        job.dump()
        print(f"bundles written in {time.perf_counter() - began:.1f} s")
    job.close(remove=args.bundles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
