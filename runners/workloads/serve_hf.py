"""The inference server's second kind of model: a causal language model in Hugging Face `transformers` format.

A folder saved with `save_pretrained` (its `config.json`, weights and tokenizer files), or the .tar.gz of
such a folder as a model version of format tar.gz keeps it, is served by `HFRunner`; the engine in
`runners.workloads.serve_engine` drives it exactly as it drives the shipped trainer's CharModel: the same bounded
queue, deadline order, token budget, continuous batching and prefix cache. Tokens are the tokenizer's.

What is batched. Every decode step runs all the running sequences in one call of the model: their KV caches
are held as one left-padded batch (one key and one value tensor a layer, `[batch, heads, length, dim]`),
with an attention mask that hides each row's padding and position ids counted per row, so rows of different
lengths step together. A joining sequence's prompt is computed on its own (one call for each joiner, from
the longest cached prefix of it), then its cache is padded into the batch. A row that leaves is cut out of
the batch, and padding no row needs any more is trimmed.

The prefix cache keeps the KV cache after every `--prefix-block` tokens of a prompt (keyed by the token
ids), so a later prompt sharing that prefix computes only the rest.
"""

from __future__ import annotations

import inspect
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from runners.workloads.serve_openai import plain_chat

MAX_UNPACKED_BYTES = 64 * 1024**3


def is_hf_folder(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def unpack_model(archive: Path) -> tuple[Path, Path]:
    """(the model folder, the temporary folder to remove) from a .tar.gz of a `save_pretrained` folder.

    Unpacked with tarfile's `data` filter: no absolute paths, no `..`, no links out of the folder, no
    devices; the folder is the archive's root, or its one top-level folder, whichever holds config.json.
    """
    temp = Path(tempfile.mkdtemp(prefix="serve-model-"))
    try:
        with tarfile.open(archive, "r:*") as tar:
            total = 0
            for member in tar:
                total += max(0, member.size)
                if total > MAX_UNPACKED_BYTES:
                    raise ValueError(f"{archive} unpacks to more than {MAX_UNPACKED_BYTES} bytes")
            tar.extractall(temp, filter="data")
        candidates = [temp] + sorted(p for p in temp.iterdir() if p.is_dir())
        for folder in candidates:
            if is_hf_folder(folder):
                return folder, temp
        raise ValueError(f"{archive} holds no config.json (at its root or in its one folder)")
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _cache_kwarg(model) -> str:
    """transformers 5 names the cache argument `cache`; older releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _as_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v, *_ in cache]


def _as_cache(layers):
    from transformers.cache_utils import DynamicCache

    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(tuple(layers))
    return DynamicCache(layers)


class HFRunner:
    """A transformers causal LM and its tokenizer behind the engine's runner interface.

    The interface (CharRunner has the same): `encode(text)` -> prompt tokens, `decode(tokens)` -> text,
    `chat(messages)` -> prompt tokens, `prefill(prompts)` -> next-token logits of each (the prompts join the
    batch as its last rows), `step(last)` -> next-token logits of every row, `keep(rows)`, `eos`, `cache`.
    """

    kind = "hf"
    allowed = None  # any text

    def __init__(self, folder: Path, device: torch.device, cache) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        # A replica's output is its own lines: no progress bars of the loading, no advice.
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        self.folder = Path(folder)
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.model = AutoModelForCausalLM.from_pretrained(self.folder).to(device).eval()
        config = json.loads((self.folder / "config.json").read_text())
        eos = config.get("eos_token_id", self.tokenizer.eos_token_id)
        eos = eos if isinstance(eos, list) else [eos]
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos = frozenset(e for e in eos if e is not None)
        self.max_positions = next(
            (config[k] for k in ("max_position_embeddings", "n_positions", "n_ctx") if isinstance(config.get(k), int)),
            None,
        )
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.cache = cache
        self.cache_kwarg = _cache_kwarg(self.model)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the batch's, left-padded
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.pos = torch.zeros(0, dtype=torch.long, device=device)

    # -- text --

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text))

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def chat(self, messages: list[dict]) -> tuple[int, ...]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return self.encode(plain_chat(messages))

    def check(self, prompt: tuple[int, ...], max_tokens: int) -> tuple[str, str] | None:
        """(field, why) when the model cannot take this request, else None."""
        if not prompt:
            return "prompt", "no tokens: the prompt must hold at least one token"
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            return "max_tokens", f"prompt tokens ({len(prompt)}) + max_tokens must be at most the model's {self.max_positions} positions"
        return None

    # -- the model --

    def _forward(self, ids: torch.Tensor, layers, **kwargs):
        extra = {self.cache_kwarg: _as_cache(layers)} if layers is not None else {}
        out = self.model(input_ids=ids, use_cache=True, **extra, **kwargs)
        cache = out.cache if self.cache_kwarg == "cache" else out.past_key_values
        return out.logits[:, -1].float(), _as_layers(cache)

    def warm_prefill(self) -> int:
        """Run one prompt (the first calls allocate); how many tokens it had."""
        self._forward(torch.zeros(1, 32, dtype=torch.long, device=self.device), None)
        return 32

    def warm_step(self) -> None:
        """Run one decode step of a 4-row batch with 32 positions cached, as `step` would."""
        if getattr(self, "_warm_layers", None) is None:
            self._warm_layers = self._forward(torch.zeros(4, 32, dtype=torch.long, device=self.device), None)[1]
        layers = self._warm_layers
        positions = torch.full((4, 1), 32, device=self.device)
        logits, _ = self._forward(torch.zeros(4, 1, dtype=torch.long, device=self.device), layers, position_ids=positions)
        logits.argmax(-1).tolist()

    def prefill(self, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """Each prompt from its longest cached prefix on, one call each; they join the batch as its last rows."""
        logits_all = []
        for prompt in prompts:
            start, state = self.cache.longest(prompt)
            ids = torch.tensor([prompt[start:]], device=self.device)
            positions = torch.arange(start, len(prompt), device=self.device).unsqueeze(0)
            logits, layers = self._forward(ids, state, position_ids=positions)
            block = self.cache.block
            for length in range((start // block + 1) * block, len(prompt) + 1, block):
                self.cache.put(prompt[:length], [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in layers])
            logits_all.append(logits[0])
            self._add_row(layers, len(prompt))
        return torch.stack(logits_all)

    def _add_row(self, layers, length: int) -> None:
        if self.kv is None or self.mask.shape[0] == 0:
            self.kv = layers
            self.mask = torch.ones(1, length, dtype=torch.long, device=self.device)
            self.pos = torch.tensor([length], device=self.device)
            return
        width = max(self.mask.shape[1], length)
        grow, pad = width - self.mask.shape[1], width - length

        def left(t: torch.Tensor, n: int) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t

        self.kv = [(torch.cat([left(bk, grow), left(k, pad)]), torch.cat([left(bv, grow), left(v, pad)]))
                   for (bk, bv), (k, v) in zip(self.kv, layers)]
        row = torch.ones(1, width, dtype=torch.long, device=self.device)
        row[:, :pad] = 0
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (grow, 0)), row])
        self.pos = torch.cat([self.pos, torch.tensor([length], device=self.device)])

    def step(self, last: torch.Tensor) -> torch.Tensor:
        batch = last.shape[0]
        self.mask = torch.cat([self.mask, torch.ones(batch, 1, dtype=torch.long, device=self.device)], 1)
        logits, self.kv = self._forward(
            last.view(batch, 1), self.kv, attention_mask=self.mask, position_ids=self.pos.view(batch, 1)
        )
        self.pos = self.pos + 1
        return logits

    def keep(self, rows: list[int]) -> None:
        if not rows:
            self.kv, self.pos = None, self.pos[:0]
            self.mask = self.mask[:0]
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = self.mask[index]
        used = mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0  # padding no row needs any more goes
        self.mask = mask[:, first:]
        self.pos = self.pos[index]
        self.kv = [(k[index][:, :, first:], v[index][:, :, first:]) for k, v in self.kv]
