"""The portal's calls as a Hugging Face `transformers.Trainer` callback.

    import gpuportal
    from gpuportal.transformers import PortalCallback

    ctx = gpuportal.init()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[PortalCallback(ctx)])
    trainer.train(resume_from_checkpoint=ctx.resume_from and str(ctx.resume_from.path))

What it does: every log (`logging_steps`) becomes a ctx.report of its numbers; every checkpoint the Trainer
saves (`checkpoint-N` in `output_dir`, after `save_steps` or a stop) is moved into ctx's folder as
`step-N` and recorded; once ctx.should_stop() (a SIGTERM, the maximum runtime), the Trainer is told to
save and to stop after the step, so `train` returns and the script can exit 0.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import transformers

import gpuportal
from gpuportal import _context


class PortalCallback(transformers.TrainerCallback):
    def __init__(self, ctx: gpuportal.Context) -> None:
        self.ctx = ctx

    def on_train_begin(self, args, state, control, **kwargs):
        # A control state restored from a checkpoint saved on a stop says "stop": this attempt goes on.
        if not self.ctx.stop_reason:
            control.should_training_stop = False
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = {
            name: float(value) for name, value in (logs or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and name not in _context.RESERVED_METRIC_NAMES
        }
        if metrics:
            self.ctx.report(state.global_step, **metrics)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # The logs of earlier steps are complete by now (this step's come after on_step_end): written now,
        # not once the next log comes `logging_steps` later.
        self.ctx._flush_if_due()
        if self.ctx.should_stop(sync=args.world_size > 1):
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if args.world_size > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # every rank has written its share (its RNG state) before the folder moves
        if self.ctx.is_main and folder.is_dir():
            self.ctx.checkpoint(state.global_step, os.fspath(folder))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.ctx.flush()
        return control
