"""The peer of bench/serve_load.py: the same model behind LitServe, given LitServe's own admission knobs.

    python bench/serve_litserve.py --checkpoint PATH --port N --config '{"max_batch_size": 64, ...}'

The knobs (LitServe 0.2.19's documented ones; `LITSERVE_KNOBS` below holds their starting values):

- `max_batch_size`, `batch_timeout` (s): LitAPI's dynamic batching: up to `max_batch_size`
  requests gathered for at most `batch_timeout` into one `predict`;
- `timeout` (s, or false for none): LitServer's request timeout: a request that waited longer
  than this in LitServe's queue is answered 504 before it is computed. It is one figure for the
  server, not one a request: the nearest LitServe comes to a per-request deadline;
- `workers_per_device`: model processes on the one device (here: the one CPU core);
- `fast_queue`: LitServe's ZeroMQ transport between its HTTP server and its workers;
- `num_api_servers`: LitServe's HTTP server processes (None: as many as model workers);
- `limit_concurrency`: uvicorn's bound on connections and tasks at once (LitServer.run passes it
  to uvicorn): past it uvicorn answers 503 at once.

The model is the trainer's `CharModel` on one CPU thread, greedy, one byte a token, its output
restricted to the checkpoint's bytes, as the portal's server runs it. `predict` runs a batch's
prompts in one packed call (as the portal's server runs its joiners), then decodes the batch
together; a row leaves the decode at its own `max_tokens`, so no row is decoded past its ask
(a static batch still answers when its longest row is done: LitServe's batched loop answers a
batch at once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LITSERVE = "litserve==0.2.19"
LITSERVE_KNOBS = {
    "max_batch_size": 64, "batch_timeout": 0.005, "timeout": 2.0, "workers_per_device": 1,
    "fast_queue": False, "limit_concurrency": None, "num_api_servers": None,
}


def load(checkpoint: str):
    """(model, mask of the bytes it may emit), on one CPU thread as the portal's engine runs it."""
    import torch

    from runners.workloads.serve_engine import load_model
    from runners.workloads.train import VOCAB

    torch.set_num_threads(1)
    model, alphabet = load_model(Path(checkpoint), torch.device("cpu"))
    mask = torch.full((VOCAB,), float("-inf"))
    mask[list(alphabet)] = 0.0
    return model, mask


def generate_batch(model, mask, prompts: list[bytes], max_tokens: list[int]) -> list[bytes]:
    """The prompts in one packed call, then one decode step at a time for the rows still short of their ask."""
    import torch
    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([model.embed(torch.tensor(list(p))) for p in prompts], enforce_sorted=False)
    _, hidden = model.rnn(packed)
    h = hidden[0]
    tokens = (model.head(h) + mask).argmax(-1)
    out = [[t] for t in tokens.tolist()]
    rows = [i for i, n in enumerate(max_tokens) if n > 1]  # row j of h and tokens is request rows[j]
    if len(rows) != len(out):
        index = torch.tensor(rows, dtype=torch.long)
        h, tokens = h[index], tokens[index]
    while rows:
        o, hidden = model.rnn(model.embed(tokens.view(-1, 1)), h.unsqueeze(0))
        h = hidden[0]
        tokens = (model.head(o[:, 0]) + mask).argmax(-1)
        for i, t in zip(rows, tokens.tolist()):
            out[i].append(t)
        keep = [j for j, i in enumerate(rows) if len(out[i]) < max_tokens[i]]
        if len(keep) != len(rows):
            index = torch.tensor(keep, dtype=torch.long)
            h, tokens = h[index], tokens[index]
            rows = [rows[j] for j in keep]
    return [bytes(row) for row in out]


try:  # only where LitServe is installed: the bench installs it when asked to compare with it
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:

    class CharModelAPI(ls.LitAPI):
        """The model behind LitServe's batched loop (module level: its workers are spawned)."""

        def __init__(self, checkpoint: str, **kwargs) -> None:
            super().__init__(**kwargs)
            self.checkpoint = checkpoint

        def setup(self, device):
            self.model, self.mask = load(self.checkpoint)

        def decode_request(self, request):
            return request["prompt"].encode(), int(request["max_tokens"])

        def batch(self, inputs):
            return inputs

        def predict(self, inputs):
            import torch

            with torch.inference_mode():
                return generate_batch(self.model, self.mask, [p for p, _ in inputs], [n for _, n in inputs])

        def unbatch(self, output):
            return output

        def encode_response(self, output):
            return {"text": output.decode(errors="replace"), "tokens": len(output)}


def run(checkpoint: str, port: int, knobs: dict) -> None:
    knobs = {**LITSERVE_KNOBS, **knobs}
    timeout = knobs["timeout"] if knobs["timeout"] else False
    api = CharModelAPI(
        checkpoint, max_batch_size=int(knobs["max_batch_size"]), batch_timeout=float(knobs["batch_timeout"]),
        api_path="/v1/generate",
    )
    server = ls.LitServer(
        api, accelerator="cpu", devices=1, workers_per_device=int(knobs["workers_per_device"]), timeout=timeout,
        fast_queue=bool(knobs["fast_queue"]),
    )
    extra = {} if knobs["limit_concurrency"] is None else {"limit_concurrency": int(knobs["limit_concurrency"])}
    servers = None if knobs["num_api_servers"] is None else int(knobs["num_api_servers"])
    server.run(port=port, host="127.0.0.1", log_level="warning", generate_client_file=False, num_api_servers=servers, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", default="{}", help="the knobs, JSON")
    args = parser.parse_args()
    if ls is None:
        sys.exit(f"LitServe is not installed: pip install {LITSERVE}")
    run(args.checkpoint, args.port, json.loads(args.config))


if __name__ == "__main__":
    main()
