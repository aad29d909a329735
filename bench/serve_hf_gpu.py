"""The shipped server on a transformers model on a GPU: a check to run on a lent GPU machine (no network needed).

    python bench/serve_hf_gpu.py [--requests 64] [--max-tokens 64] [--layers 4] [--width 256] [--device cuda]

It builds a randomly initialised GPT-2 and a tokenizer trained on a few lines (nothing is downloaded),
saves them with save_pretrained, starts `python -m runners.workloads.serve --device cuda` on the folder,
sends every request at once (so they are batched, left-padded, in the engine), and checks each greedy
answer against transformers' own `generate` for that prompt alone on the same GPU. It prints one JSON
line: the device the server reports, how many answers matched, the wall time and tokens a second.
Exit 0 when every answer matched, 1 otherwise, 2 without a GPU. `--device cpu` runs the same check on the
CPU (a dry run of the script where there is no GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LINES = [
    "the quick brown fox jumps over the lazy dog",
    "a gpu portal serves models at the edge of the cluster",
    "you are the portal's assistant: answer briefly and kindly",
    "hello world, what is a gpu and how many do i have?",
]


def build(folder: Path, layers: int, width: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_head=4, n_embd=width, n_positions=1024, vocab_size=len(tokenizer),
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, initializer_range=0.5)
    GPT2LMHeadModel(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def reference(folder: Path, prompts: list[str], max_tokens: int, device: str) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)], device=device)
            new = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
            if tokenizer.eos_token_id in new:
                new = new[: new.index(tokenizer.eos_token_id)]
            out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU"}))
        return 2
    folder = Path(tempfile.mkdtemp(prefix="serve-hf-gpu-"))
    build(folder, args.layers, args.width)
    prompts = [f"{LINES[i % len(LINES)]} #{i}" for i in range(args.requests)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    server = subprocess.Popen(
        [sys.executable, "-m", "runners.workloads.serve", "--checkpoint", str(folder), "--port", "0",
         "--device", args.device, "--max-tokens", str(args.max_tokens), "--queue-limit", str(args.requests)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = server.stdout.readline()
        listening = json.loads(line.split(" ", 1)[1])
        url = f"http://127.0.0.1:{listening['port']}/v1/completions"

        def ask(prompt: str) -> str:
            body = json.dumps({"prompt": prompt, "max_tokens": args.max_tokens, "deadline_ms": 60_000}).encode()
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as answer:
                return json.loads(answer.read())

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            answers = list(pool.map(ask, prompts))
        wall = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(60)
    expected = reference(folder, prompts, args.max_tokens, args.device)
    shutil.rmtree(folder, ignore_errors=True)
    matched = sum(a["choices"][0]["text"] == e for a, e in zip(answers, expected))
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    print(json.dumps({"device": listening["device"], "requests": args.requests, "matched": matched,
                      "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
                      "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}))
    return 0 if matched == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
