"""Overhead of obs on training steps: plain PyTorch vs obs idle vs module-level event recording.

Run: python tests/perf/bench_overhead.py [--rounds 30] [--out bench-overhead.json]
Targets (issue "Foundation"): idle <= 1% over plain; module recording <= 3% (MLP), <= 1% (CNN).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import obs

from _harness import cnn, measure, mlp, report


def plain():
    return lambda: None


def idle():
    obs.set_context(device_target="CPU", mode=obs.PYNATIVE_MODE, save_graphs=0)
    return obs.reset_context


def module_recording():
    ring: collections.deque = collections.deque(maxlen=4096)
    clock = time.perf_counter_ns

    def on_enter(scope, module):
        ring.append((0, scope, clock()))

    def on_exit(scope, module, error):
        ring.append((1, scope, clock()))

    subs = [obs.subscribe(obs.Event.MODULE_ENTER, on_enter), obs.subscribe(obs.Event.MODULE_EXIT, on_exit)]

    def teardown():
        for sub in subs:
            sub.remove()
        assert ring, "the recording subscriber saw no module events"
    return teardown


def torch_global_hooks_noop():
    """Reference: what PyTorch's own global forward hooks cost doing nothing (why obs wraps __call__)."""
    from torch.nn.modules import module as nn_module

    handles = [nn_module.register_module_forward_pre_hook(lambda m, a: None),
               nn_module.register_module_forward_hook(lambda m, a, o: None, always_call=True)]
    return lambda: [h.remove() for h in handles]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="bench-overhead.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = {"plain": plain, "obs idle": idle, "obs module recording": module_recording,
                "torch global hooks (no-op)": torch_global_hooks_noop}
    results = {w.name: measure(w, variants, args.rounds) for w in (mlp(), cnn())}
    report("bench_overhead", results, "plain", args.out,
           {"targets": {"obs idle": "<= 1.01", "obs module recording": {"mlp": "<= 1.03", "cnn": "<= 1.01"}}})


if __name__ == "__main__":
    main()
