"""The portal's calls as a PyTorch Lightning callback.

    import gpuportal
    from gpuportal.lightning import PortalCallback

    ctx = gpuportal.init()
    trainer = lightning.Trainer(max_steps=1000, callbacks=[PortalCallback(ctx, every_n_steps=100)])
    trainer.fit(model, data, ckpt_path=ctx.resume_from and ctx.resume_from.path)

What it does: reports the logged metrics after each training batch; saves a checkpoint every
`every_n_steps` optimizer steps (0: only on a stop), and at the end of training unless `save_at_end` is
False, with `trainer.save_checkpoint`, into ctx's folder, and records it; once ctx.should_stop() (a SIGTERM, the maximum runtime), saves one more and sets
`trainer.should_stop`, so `fit` returns and the script can exit 0. Lightning's own SIGTERM handling (which
ends `fit` with an exception and no checkpoint) is put aside for the SDK's while training runs.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl

import gpuportal
from gpuportal import _context


class PortalCallback(pl.Callback):
    def __init__(self, ctx: gpuportal.Context, *, every_n_steps: int = 0, save_at_end: bool = True) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be 0 or more, not {every_n_steps}")
        self.ctx = ctx
        self.every_n_steps = every_n_steps
        self.save_at_end = save_at_end
        self._saved_step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning put its SIGTERM handler in at the start of fit (it ends training with SIGTERMException);
        # the SDK's goes back in front, so a SIGTERM only asks for a stop that this callback checkpoints.
        # Lightning's teardown restores the handler that was there before fit: the SDK's again.
        if self.ctx._handle_signals:
            _context._signals.install()
        self._saved_step = trainer.global_step if self.ctx.resume_from else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        metrics = {}
        for name, value in trainer.callback_metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
            if math.isfinite(number) and name not in _context.RESERVED_METRIC_NAMES:
                metrics[name] = number
        if metrics:
            self.ctx.report(step, **metrics)
        stopping = self.ctx.should_stop(sync=trainer.world_size > 1)
        due = self.every_n_steps and step % self.every_n_steps == 0
        if (stopping or due) and step != self._saved_step:
            self.save(trainer, step)
        if stopping:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_at_end and trainer.global_step and trainer.global_step != self._saved_step:
            self.save(trainer, trainer.global_step)
        self.ctx.flush()

    def save(self, trainer: pl.Trainer, step: int) -> None:
        """trainer.save_checkpoint into a temporary name in ctx's folder (every rank calls it; rank 0 writes),
        then ctx.checkpoint gives it its name and records it."""
        self.ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        temp = self.ctx.checkpoint_dir / f".step-{step:08d}.tmp-lightning.ckpt"  # a name no reader takes
        trainer.save_checkpoint(temp)
        trainer.strategy.barrier("gpuportal-checkpoint")
        if self.ctx.is_main:
            self.ctx.checkpoint(step, temp)
        self._saved_step = step
