"""What the portal knows of each engine an inference replica may run, in one place. Pure: no Django, no app.

An endpoint names its engine: "shipped" (the portal's own server, runners.workloads.serve) or a foreign,
OpenAI-compatible one from an allowed registry's image, on Kubernetes only: "vllm", "tgi" (Hugging Face's
text-generation-inference) or "sglang". For each, this module holds:

- how its container is started to serve one model on the replica's port (`engine_command`): the command and
  flags each engine documents, built from the endpoint's named settings (`EngineSettings`), never from raw
  arguments a tenant passes through;
- its health routes (`health_path` for readiness, which the reconcile and the edge read; `liveness_path`
  for the kubelet's liveness probe);
- how its own Prometheus metrics map to the autoscaler's signals (`read_metrics`): requests running,
  requests waiting, KV-cache use (0..1, None where the engine exports none).

Facts, as each engine documents them:

- vLLM: `vllm serve MODEL --host --port --served-model-name --tensor-parallel-size --max-model-len --dtype`;
  `/health` answers 200 once the engine is up; `/metrics` has the gauges `vllm:num_requests_running`,
  `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before v1), 1 = full.
- TGI: `text-generation-launcher --model-id --hostname --port --num-shard --max-input-tokens --max-total-tokens
  --dtype` (float16 or bfloat16 only); `/health`; `/metrics` on the same port, `tgi_queue_size` (waiting) and
  `tgi_batch_current_size` (running); no KV-cache gauge.
- SGLang: `python3 -m sglang.launch_server --model-path --host --port --tp-size --context-length --dtype
  --served-model-name --enable-metrics` (metrics are off without the flag); `/health`; `/metrics` has
  `sglang:num_running_reqs`, `sglang:num_queue_reqs` and `sglang:token_usage` (the KV pool's use, 0..1).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SHIPPED = "shipped"
VLLM = "vllm"
TGI = "tgi"
SGLANG = "sglang"
ENGINES = (SHIPPED, VLLM, TGI, SGLANG)
FOREIGN_ENGINES = (VLLM, TGI, SGLANG)
DTYPES = ("auto", "float16", "bfloat16", "float32")
# The longest context an endpoint may ask an engine for (tokens).
MAX_MODEL_LEN = (16, 1_048_576)


@dataclass(frozen=True)
class EngineSettings:
    """A foreign engine's settings, as the endpoint's spec names them (checked there): each becomes the flag its
    engine documents for it. ``max_model_len``: the longest prompt plus completion (None: the model's own);
    ``dtype``: the weights' type ("auto": the model's own)."""

    max_model_len: int | None = None
    dtype: str = "auto"


@dataclass(frozen=True)
class EngineSignals:
    """What one replica's engine reports, in the autoscaler's terms."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests admitted and waiting for the batch
    kv_cache_use: float | None = None  # 0..1; None where the engine exports none


@dataclass(frozen=True)
class _Engine:
    ready: str  # readiness: 200 once it serves
    live: str  # liveness: answers while the process is sound
    running: tuple[str, ...]  # Prometheus names, the first one present counts
    waiting: tuple[str, ...]
    kv_cache: tuple[str, ...] = ()
    # The dtypes its flag takes besides "auto" (which is never passed: the engine's own default).
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")


_ENGINES = {
    # The shipped server: /readyz is false while it loads and once it drains; /healthz while the process lives.
    SHIPPED: _Engine(ready="/readyz", live="/healthz", running=("serve_running_sequences",),
                     waiting=("serve_queue_depth",)),
    VLLM: _Engine(ready="/health", live="/health", running=("vllm:num_requests_running",),
                  waiting=("vllm:num_requests_waiting",),
                  kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    TGI: _Engine(ready="/health", live="/health", running=("tgi_batch_current_size",), waiting=("tgi_queue_size",),
                 dtypes=("float16", "bfloat16")),
    SGLANG: _Engine(ready="/health", live="/health", running=("sglang:num_running_reqs",),
                    waiting=("sglang:num_queue_reqs",), kv_cache=("sglang:token_usage",)),
}


def _engine(engine: str) -> _Engine:
    try:
        return _ENGINES[engine]
    except KeyError:
        raise ValueError(f"Unknown engine {engine!r}; one of {', '.join(ENGINES)}.") from None


def health_path(engine: str) -> str:
    """The route that answers 200 while a replica of this engine takes requests (its readiness)."""
    return _engine(engine).ready


def liveness_path(engine: str) -> str:
    """The route the kubelet's liveness probe reads: it answers while the engine's process is sound."""
    return _engine(engine).live


def metrics_path(engine: str) -> str:
    """Where the engine serves its Prometheus metrics: /metrics on the serving port, for every engine."""
    _engine(engine)
    return "/metrics"


def dtypes(engine: str) -> tuple[str, ...]:
    """The dtypes an endpoint may ask this engine for ("auto" always)."""
    return ("auto", *_engine(engine).dtypes)


def engine_command(engine: str, *, model: str, port: int, gpus: int, served_name: str,
                   settings: EngineSettings) -> tuple[list[str], list[str]]:
    """(command, args) of a foreign engine's container serving ``model`` (a folder in the container, or a name
    the engine resolves) on ``port`` of every address, over ``gpus`` GPUs, answering to ``served_name``."""
    if engine not in FOREIGN_ENGINES:
        raise ValueError(f"{engine!r} is not a foreign engine; one of {', '.join(FOREIGN_ENGINES)}.")
    if settings.dtype != "auto" and settings.dtype not in _engine(engine).dtypes:
        raise ValueError(f"{engine} takes no dtype {settings.dtype!r}; one of {', '.join(dtypes(engine))}.")
    length = settings.max_model_len
    dtype = [] if settings.dtype == "auto" else ["--dtype", settings.dtype]
    if engine == VLLM:
        return ["vllm", "serve"], [
            model, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", served_name,
            "--tensor-parallel-size", str(gpus), *(["--max-model-len", str(length)] if length else []), *dtype,
        ]
    if engine == TGI:
        # TGI checks that a prompt leaves room for at least one new token: the input bound is one below the total.
        lengths = ["--max-input-tokens", str(length - 1), "--max-total-tokens", str(length)] if length else []
        return ["text-generation-launcher"], [
            "--model-id", model, "--hostname", "0.0.0.0", "--port", str(port), "--num-shard", str(gpus),
            *lengths, *dtype,
        ]
    return ["python3", "-m", "sglang.launch_server"], [
        "--model-path", model, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", served_name,
        "--tp-size", str(gpus), "--enable-metrics", *(["--context-length", str(length)] if length else []), *dtype,
    ]


def read_metrics(engine: str, text: str) -> EngineSignals:
    """The autoscaler's signals from an engine's /metrics text (Prometheus exposition format).

    Running and waiting are summed over the samples of the first name present (an engine labels them by
    model, or by engine process); KV-cache use is the highest sample. A name the engine does not export
    reads 0 (None for the KV cache). ValueError when the text is not Prometheus' format."""
    spec = _engine(engine)
    values: dict[str, list[float]] = {}
    wanted = {*spec.running, *spec.waiting, *spec.kv_cache}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values.setdefault(sample.name, []).append(sample.value)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((values[name] for name in names if name in values), None)

    running, waiting, kv = first(spec.running), first(spec.waiting), first(spec.kv_cache)
    return EngineSignals(
        running=int(sum(running)) if running else 0,
        waiting=int(sum(waiting)) if waiting else 0,
        kv_cache_use=min(1.0, max(0.0, max(kv))) if kv else None,
    )
