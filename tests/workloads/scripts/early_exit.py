"""Rank 0 leaves at once after its destroy; rank 1 waits, still reaches the rendezvous store (only a store
that outlives rank 0 answers), then destroys its own group and writes what it found to OUT_DIR (or the
job folder)."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if rank == 0:
    dist.destroy_process_group()
    sys.exit(0)
time.sleep(2)
store = distributed_c10d._get_default_store()
store.set("after-rank-0", "still here")
found = store.get("after-rank-0").decode()
dist.destroy_process_group()
with open(os.path.join(os.environ.get("OUT_DIR") or os.environ["TRAIN_JOB_DIR"], "rank-1.json"), "w") as stream:
    json.dump({"sum": total.item(), "store": found}, stream)
