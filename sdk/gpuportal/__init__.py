"""The GPU portal's SDK: what a team's training script imports to report progress, save checkpoints the
portal knows about, and learn that the portal asked it to stop.

    import gpuportal

    ctx = gpuportal.init()
    state = ctx.load()                      # None, or the state of ctx.resume_from
    for step in range(start, steps):
        with ctx.busy():
            loss = train_one_step()
        ctx.report(step + 1, loss=loss)
        if ctx.should_stop():
            ctx.checkpoint(step + 1, {"model": model.state_dict(), ...})
            break

Stdlib only at import (the portal's web process imports `gpuportal._protocol`); torch is imported inside
the calls that need it. The callbacks are in `gpuportal.lightning` and `gpuportal.transformers`.
See docs/sdk.md.
"""

from gpuportal._context import Context, ResumePoint, init, write_checkpoint
from gpuportal._protocol import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_FAILED, EXIT_OK

__all__ = ["EXIT_CHECKPOINTED_ON_SIGNAL", "EXIT_FAILED", "EXIT_OK", "Context", "ResumePoint", "init", "write_checkpoint"]
