"""Plain PyTorch DDP on the portal: a linear model fitted to synthetic data, one process per rank.

Run by the portal as {"template": "script", "command": ["python", "train.py"], "hyperparameters": {"steps": 500}}.
"""

import gc
import time

import gpuportal
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ctx = gpuportal.init()  # rank, world size, job folder, hyperparameters, stop handling
# step_s: the least a step lasts, in seconds (0: as fast as it goes), to watch a run or preempt one by hand
hp = {"steps": 200, "lr": 0.05, "batch_size": 32, "checkpoint_every": 50, "step_s": 0, **ctx.hyperparameters}
dist.init_process_group("gloo", init_method="env://", rank=ctx.rank, world_size=ctx.world_size)

torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=hp["lr"])
start = 0
if (state := ctx.load()) is not None:  # the newest checkpoint, after a preemption or a lost node
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = ctx.resume_from.step
    print(f"resuming after step {start}, from {ctx.resume_from.path.name}", flush=True)

truth = torch.arange(8.0).unsqueeze(1)
for step in range(start + 1, hp["steps"] + 1):
    batch = torch.Generator().manual_seed(step * ctx.world_size + ctx.rank)  # each rank and step its own data
    x = torch.randn(hp["batch_size"], 8, generator=batch)
    y = x @ truth + 0.1 * torch.randn(hp["batch_size"], 1, generator=batch)
    began = time.monotonic()
    with ctx.busy():
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ctx.report(step, loss=loss.item())
    time.sleep(max(0.0, hp["step_s"] - (time.monotonic() - began)))
    stopping = ctx.should_stop(sync=True)  # every rank stops at the same step
    if stopping or step % hp["checkpoint_every"] == 0 or step == hp["steps"]:
        ctx.checkpoint(step, {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()})
    if stopping:
        break
dist.barrier()  # every rank here (rank 0 has written the last checkpoint) before the group is torn down
del model, optimizer, loss  # DDP holds the group: free it now, not in gloo's threads at interpreter exit
gc.collect()
dist.destroy_process_group()
