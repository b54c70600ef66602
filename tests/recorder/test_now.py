"""recorder.now's open collective and newest sequence numbers, against a plain loop over the slots (real rings)."""

from __future__ import annotations

import random
import time

from recorder.collective_desc import COLLECTIVE_STATES, collective_desc, parse_collective_desc
from recorder.layout import DEFAULT_CAPACITY, PHASE_CODES, Kind
from recorder.now import now
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring


def _by_loop(contents):
    """What now() says of the collectives, the slow way: each slot in order."""
    opened, last_seq = {}, {}
    for slot in contents.slots[contents.slots["kind"] == Kind.COLLECTIVE]:
        fields = parse_collective_desc(contents.string(int(slot["a"])))
        key, state, t = (fields["group"], int(slot["b"])), int(slot["d"]), int(slot["t"])
        last_seq[key[0]] = max(last_seq.get(key[0], 0), key[1])
        if state in (0, 1):
            opened[key] = (fields["op"], opened[key][1] if key in opened else t, state)
        else:
            opened.pop(key, None)
    if not opened:
        return None, last_seq
    (group, seq), (op, first, state) = max(opened.items(), key=lambda kv: kv[1][1])
    return {"group": group, "seq": seq, "op": op, "state": COLLECTIVE_STATES[state],
            "since_ns": contents.header.wall(first)}, last_seq


def test_the_open_collective_and_each_groups_newest_seq_match_a_plain_loop(tmp_path):
    rng = random.Random(5)
    for trial in range(20):
        ring = RingWriter(str(tmp_path / f"r{trial}.obsring"), {**DEFAULT_CAPACITY, "collective": 64}, pid=1, rank=0,
                          world_size=2, meta={"run_id": "j", "host": "h", "granularity": "step"})
        coll = ring.appender("collective")
        descs = [ring.intern(collective_desc({"op": op, "group": g, "dtype": "float32", "sizes": [[2]]}))
                 for op, g in (("all_reduce", "default"), ("broadcast", "default"), ("all_gather", "3"))]
        seqs = {0: 0, 1: 0, 2: 0}
        for _ in range(rng.randrange(0, 150)):  # wraps the 64-slot ring in most trials
            which = rng.randrange(3)
            group = 2 if which == 2 else 0
            if rng.random() < 0.6 or seqs[group] == 0:
                seqs[group] += 1
            coll(Kind.COLLECTIVE, 0, descs[which], seqs[group], 5, rng.choice((0, 1, 2, 2, 3)))
        contents = read_ring(ring.buffer())
        ring.close(remove=True)
        doing = now(contents)
        assert (doing["collective"], doing["last_seq"]) == _by_loop(contents), trial


def test_a_module_called_after_the_optimizer_stopped_for_its_closure_is_forward(tmp_path):
    ring = RingWriter(str(tmp_path / "r.obsring"), DEFAULT_CAPACITY, pid=1, rank=0, world_size=1,
                      meta={"run_id": "j", "host": "h", "granularity": "module"})
    step, module = ring.appender("step"), ring.appender("module")
    net = ring.intern("Default/net-Net")
    step(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
    began = time.perf_counter_ns()
    step(Kind.PHASE, 0, PHASE_CODES["optimizer"], 1, began, time.perf_counter_ns())  # optimizer.step(closure)
    assert now(read_ring(ring.buffer()))["phase"]["name"] == "after optimizer"
    module(Kind.MODULE_ENTER, 0, net, 1, 0, 0)  # the closure's forward
    assert now(read_ring(ring.buffer()))["phase"]["name"] == "forward"
    module(Kind.MODULE_EXIT, 0, net, 1, 0, 0)
    step(Kind.PHASE, 0, PHASE_CODES["forward"], 1, began, time.perf_counter_ns())
    assert now(read_ring(ring.buffer()))["phase"]["name"] == "backward"
    ring.close(remove=True)
