"""The SIGKILL run of test_ring.py: the tiny GPT of test_training.py with the monitor and the RDR on, block 1's MLP
given 50 times its learning rate for 3 steps at step 200, killed with SIGKILL after step KILL_AT - 1.

Usage: python ring_script.py CONFIG KILL_AT.  With ``on_anomaly: [bundle, capture]`` in CONFIG, the anomaly writes a
bundle and a capture while it runs.  The monitor's worker is flushed before the kill, so that the ring holds every
step up to the kill (without it the last ~50 ms of steps may not be judged yet)."""

from __future__ import annotations

import os
import signal
import sys

import torch

import obs
from obs.features.monitor.feature import feature
from tests.obs.features.monitor.gpt import GPT, batches

SPIKE = 200


def main(config: str, kill_at: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT()
    mlp = [p for n, p in model.named_parameters() if n.startswith("h.1.mlp.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("h.1.mlp.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": mlp}], lr=1e-3)
    obs.set_context(env_config_path=config)
    for step, (x, y) in enumerate(batches(kill_at)):
        opt.param_groups[1]["lr"] = 5e-2 if SPIKE <= step < SPIKE + 3 else 1e-3
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert feature.monitor is not None and feature.monitor.flush()
    actions = feature.monitor.actions
    for window in actions.captures if actions is not None else ():
        assert window.done, "the capture's data dump did not end"
    print("monitor-folder", feature.monitor.folder, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
