"""A small real training run with the profiler on, for the exporter tests (run as a subprocess).

argv[1]: JSON with ``context`` (set_context keys), ``steps``, ``loader`` (use obs.steps), ``kill_at`` (SIGKILL
itself in that step's backward), ``sleep_ms`` (per step), ``reset`` (reset_context before exiting),
``config`` (an env config file to set and then watch: the test rewrites it), ``wait_file`` (a file whose
content names the step to wait for before going on: hot reload tests), ``times`` (print each step's wall time,
as JSON, at the end).
"""

import json
import os
import signal
import sys
import time

import torch

import obs

args = json.loads(sys.argv[1])
context = dict(args.get("context", {}))
if args.get("config"):
    context["env_config_path"] = args["config"]
obs.set_context(**context)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()), torch.nn.Linear(32, 4))
loss_fn = torch.nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(args.get("steps", 20))]
items = obs.steps(data) if args.get("loader", True) else iter(data)
took = []
for i, (x, y) in enumerate(items, start=1):
    began = time.perf_counter()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    if args.get("kill_at") == i:
        sys.stdout.write("killing\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    opt.step()
    if args.get("sleep_ms"):
        time.sleep(args["sleep_ms"] / 1000)
    if args.get("pause_at") == i:
        sys.stdout.write(f"paused {i}\n")
        sys.stdout.flush()
        sys.stdin.readline()  # the test edits the config, then lets us go on
    took.append(time.perf_counter() - began)
if args.get("times"):
    print("times", json.dumps(took), flush=True)
if args.get("reset"):
    obs.reset_context()
print("done", flush=True)
