"""A process that is signalled in a chosen state; tests/recorder/test_signals.py sends the real signals.

Usage: python signals_script.py SCENARIO RDR_PATH
Trains 3 steps with the recorder on, then (printing a line the test waits for):

blocked_in_c   the main thread blocks in C for good (a second lock of a plain pthread mutex, GIL released)
full_dump      fills the rings, then dumps in a loop ("DUMPING"); the test signals 50 ms into a dump
prev_handler   a SIGTERM handler installed before obs prints PREV and exits 7; then sleeps in Python
user_ignores   a SIGTERM handler installed before obs does nothing; sleeps in Python ("WAITING")
asyncio        an asyncio loop with a SIGUSR1 handler (wakeup fd) started before obs; prints the fds
sleep          sleeps in Python (time.sleep), the main thread free to run handlers
slow_dump      as sleep, but every dump takes 600 s (a fault injected into the stack collection)
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import threading
import time

import torch
from sgd import SGD  # this folder's: torch.optim would import torch._dynamo

import obs

SCENARIO, RDR_PATH = sys.argv[1], sys.argv[2]
CONFIG = os.path.join(RDR_PATH, "obs.json")


def start_obs() -> None:
    with open(CONFIG, "w") as fh:
        json.dump({"rdr": {"enable": True, "path": RDR_PATH}}, fh)
    obs.set_context(env_config_path=CONFIG)


def train(net: torch.nn.Module, steps: int) -> None:
    opt = SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        with obs.step():
            net(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()


def small() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def blocked_in_c() -> None:
    libc = ctypes.CDLL(None)  # CDLL calls release the GIL
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on Linux
    libc.pthread_mutex_lock(mutex)
    main, line = threading.get_ident(), sys._getframe().f_lineno + 9

    def announce() -> None:  # "BLOCKED" only once the main thread is in the C call below
        while sys._current_frames()[main].f_lineno != line:
            time.sleep(0.01)
        time.sleep(0.2)
        print("BLOCKED", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    libc.pthread_mutex_lock(mutex)  # a default mutex locked twice: never returns, EINTR or not


def main() -> None:
    if SCENARIO in ("prev_handler", "user_ignores"):
        def prev(signum, frame):
            print("PREV", flush=True)
            if SCENARIO == "prev_handler":
                sys.exit(7)
        signal.signal(signal.SIGTERM, prev)
    if SCENARIO == "asyncio":
        asyncio.run(with_asyncio())
        return
    start_obs()
    if SCENARIO == "slow_dump":
        import recorder.recorder

        def slow_stacks():
            time.sleep(600)  # far beyond the test's liveness bound: the process ends only if the dump is abandoned
            return []
        recorder.recorder.all_stacks = slow_stacks
    if SCENARIO == "full_dump":
        net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(50)])
        train(net, 1)
        with torch.no_grad():
            for _ in range(1500):
                net(torch.randn(1, 8))
        print("DUMPING", flush=True)
        while True:
            obs.rdr.dump("manual")
    train(small(), 3)
    if SCENARIO == "blocked_in_c":
        blocked_in_c()
    print("WAITING", flush=True)
    for _ in range(600):
        time.sleep(0.1)
    print("NOT SIGNALLED", flush=True)


async def with_asyncio() -> None:
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, got.set)
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    start_obs()
    after = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(after)
    train(small(), 3)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(got.wait(), 30)
    print(json.dumps({"wakeup_fd_before": before, "wakeup_fd_after": after, "sigusr1": got.is_set()}), flush=True)
    print("WAITING", flush=True)
    await asyncio.sleep(60)
    print("NOT SIGNALLED", flush=True)


main()
