"""A plain training loop on the SDK, for the tests; what it does is steered by its hyperparameters.

steps (default: until stopped), sleep_s (inside busy(), per step), every (a checkpoint every this many steps;
0: only on a stop), payload_mb (the size of each checkpoint), hang_after (after this step, sleep outside busy()
for ever, as a script stuck on its data would), exit_75 (leave with exit_stopped() after a stop).
Before init() it installs a SIGTERM handler of its own that writes `chained` in the job folder, to show the SDK
calls it; its on_stop callback writes the reason to `on_stop` there.
"""

import os
import signal
import sys
import time
from pathlib import Path

import gpuportal
import torch


def own_handler(signum, frame):
    Path(os.environ["TRAIN_JOB_DIR"], "chained").write_text(signal.Signals(signum).name)


signal.signal(signal.SIGTERM, own_handler)
ctx = gpuportal.init(metrics_interval_s=0)
ctx.on_stop(lambda reason: Path(ctx.job_dir, "on_stop").write_text(reason))
hp = {"steps": sys.maxsize, "sleep_s": 0.02, "every": 0, "payload_mb": 0, "hang_after": None, "exit_75": False,
      **ctx.hyperparameters}
state = ctx.load()
print(f"resuming from {ctx.resume_from.step if ctx.resume_from else None}", flush=True)
step = state["step"] if state else 0
while step < hp["steps"]:
    with ctx.busy():
        time.sleep(hp["sleep_s"])
    step += 1
    ctx.report(step, loss=1.0 / step)
    if step == hp["hang_after"]:
        ctx.flush()
        while True:
            time.sleep(1)
    stopping = ctx.should_stop()
    if stopping or (hp["every"] and step % hp["every"] == 0):
        ctx.checkpoint(step, {"step": step, "payload": torch.ones(hp["payload_mb"] * 2**18)})
    if stopping:
        print(f"stopped at step {step}: {ctx.stop_reason}", flush=True)
        if hp["exit_75"]:
            ctx.exit_stopped()
        break
print(f"done at step {step}", flush=True)
