"""One rank of a small DDP job (gloo, CPU) with the profiler on; run under torchrun by the tests."""

import torch
import torch.distributed as dist

import obs

obs.set_context(enable_profiling=True)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                                      torch.nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in obs.steps([torch.randn(4, 8) for _ in range(6)]):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
dist.destroy_process_group()
