"""A tiny transformers.Trainer run on the SDK's callback, for the tests: a one-layer GPT-2 of 380 parameters
on random tokens.

Hyperparameters: max_steps (default: run until stopped), save_steps (0: only on a stop), sleep_s (per step,
so a test can signal it mid-run), resumed_sleep_s (per step of a resumed run; default sleep_s). It prints the
step training starts at, once the Trainer has restored the checkpoint. Nothing is downloaded: the model is
made from its config, and the Hub is told it is offline.
"""

import os
import time

# Set here, not in the job's env: the portal's env policy keeps HF_* to the host.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gpuportal
import torch
import transformers
from gpuportal.transformers import PortalCallback

ctx = gpuportal.init(metrics_interval_s=0)
hp = {"max_steps": 1_000_000, "save_steps": 0, "sleep_s": 0.02, **ctx.hyperparameters}
sleep_s = hp.get("resumed_sleep_s", hp["sleep_s"]) if ctx.resume_from else hp["sleep_s"]


class Slowed(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"training starts at step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(sleep_s)


torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=1, n_head=2, n_embd=4, vocab_size=16, n_positions=16, bos_token_id=0, eos_token_id=0))
tokens = torch.randint(0, 16, (512, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in tokens]
args = transformers.TrainingArguments(
    output_dir=str(ctx.job_dir / "hf-output"), max_steps=hp["max_steps"], per_device_train_batch_size=8,
    learning_rate=1e-3, logging_steps=1, save_strategy="steps" if hp["save_steps"] else "no",
    save_steps=hp["save_steps"] or 500, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
)
trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[PortalCallback(ctx), Slowed()])
print(f"resuming from {ctx.resume_from.step if ctx.resume_from else None}", flush=True)
trainer.train(resume_from_checkpoint=ctx.resume_from and str(ctx.resume_from.path))
print(f"train returned at step {trainer.state.global_step}", flush=True)
