"""A small training run that fails in a chosen way; the RDR tests run it as a real subprocess.

Usage: python train_script.py SCENARIO CONFIG_JSON [OP_TIMEOUT]
The fault happens in step 3 (after two good steps).  Prints "READY" once RDR is on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import torch
from sgd import SGD  # this folder's: torch.optim would import torch._dynamo

import obs

SCENARIO, CONFIG = sys.argv[1], sys.argv[2]
obs.set_context(env_config_path=CONFIG, op_timeout=int(sys.argv[3]) if len(sys.argv) > 3 else 900)
print("READY", flush=True)


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward at step 3")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(16, 2)

    def forward(self, x, step):
        h = self.act(self.fc1(x))
        if step == 3:
            fault(self, h)
        return self.fc2(h)


def fault(net, h):
    if SCENARIO == "forward":
        raise ValueError("boom in forward at step 3")
    if SCENARIO == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if SCENARIO == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
    if SCENARIO == "segfault":
        ctypes.string_at(0)
    if SCENARIO == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if SCENARIO == "hang":
        time.sleep(3.5)
    if SCENARIO == "thread":
        worker = threading.Thread(target=lambda: 1 / 0, name="loader-worker")
        worker.start()
        worker.join()
    if SCENARIO == "caught_twice":
        for _ in range(2):
            try:
                net.fc2(torch.ones(4, 5))  # wrong width: fc2 raises, the module fault dumps
            except RuntimeError:
                pass


torch.manual_seed(0)
net = Net()
opt = SGD(net.parameters(), lr=0.1)
for step in range(1, 6):
    with obs.step():
        x = torch.randn(4, 8)
        out = net(x, step)
        if SCENARIO == "backward" and step == 3:
            out = Explode.apply(out)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        obs.Print("loss", loss.detach())
if SCENARIO == "dump_loop":
    print("DUMPING", flush=True)
    while True:
        obs.rdr.dump("manual")
print("DONE", flush=True)
