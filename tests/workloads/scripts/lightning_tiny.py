"""A tiny Lightning run on the SDK's callback, for the tests: a linear model on synthetic data.

Hyperparameters: max_steps (default: run until stopped), every (checkpoint every this many steps; 0: only on
a stop), sleep_s (per step, so a test can signal it mid-run), resumed_sleep_s (per step of a resumed run;
default sleep_s). It prints the step training starts at, once Lightning has restored the checkpoint.
"""

import time

import gpuportal
import lightning.pytorch as pl
import torch
from gpuportal.lightning import PortalCallback
from torch.utils.data import DataLoader, TensorDataset

ctx = gpuportal.init(metrics_interval_s=0)
hp = {"max_steps": 1_000_000, "every": 0, "sleep_s": 0.02, **ctx.hyperparameters}
sleep_s = hp.get("resumed_sleep_s", hp["sleep_s"]) if ctx.resume_from else hp["sleep_s"]


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with ctx.busy():
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        time.sleep(sleep_s)
        return loss

    def on_train_start(self) -> None:
        print(f"training starts at step {self.trainer.global_step}", flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
trainer = pl.Trainer(
    max_steps=hp["max_steps"], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    callbacks=[PortalCallback(ctx, every_n_steps=hp["every"])],
)
print(f"resuming from {ctx.resume_from.step if ctx.resume_from else None}", flush=True)
trainer.fit(Tiny(), data, ckpt_path=ctx.resume_from and ctx.resume_from.path)
print(f"fit returned at step {trainer.global_step}", flush=True)
