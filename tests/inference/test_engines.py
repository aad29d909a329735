"""The per-engine knowledge (runners.backends.engines): health routes, and each engine's own Prometheus names read as
the autoscaler's signals; and the autoscaler's answer to a full KV cache. Pure."""

import pytest

from runners.backends import engines
from runners.inference import autoscale

pytestmark = pytest.mark.unit

# What each engine's /metrics looks like (the names and shapes each one documents), trimmed.
VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 3.0
vllm:num_requests_running{engine="1",model_name="chat"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="chat"} 7.0
vllm:num_requests_waiting{engine="1",model_name="chat"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="chat"} 0.93
vllm:kv_cache_usage_perc{engine="1",model_name="chat"} 0.41
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="chat"} 1234.0
"""
VLLM_V0 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="chat"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="chat"} 4.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="chat"} 0.25
"""
TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 12
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 4096
"""
SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="chat"} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="chat"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="chat"} 0.28
"""


def test_each_engine_says_which_route_tells_its_readiness():
    assert engines.health_path("shipped") == "/readyz"
    assert [engines.health_path(engine) for engine in ("vllm", "tgi", "sglang")] == ["/health"] * 3
    assert engines.liveness_path("shipped") == "/healthz" and engines.liveness_path("vllm") == "/health"
    with pytest.raises(ValueError, match="Unknown engine 'triton'"):
        engines.health_path("triton")


@pytest.mark.parametrize(("engine", "text", "expected"), [
    # vLLM v1 labels by engine process: running and waiting add up, the fullest KV cache counts.
    ("vllm", VLLM_V1, engines.EngineSignals(running=5, waiting=7, kv_cache_use=0.93)),
    ("vllm", VLLM_V0, engines.EngineSignals(running=1, waiting=4, kv_cache_use=0.25)),  # the name before v1
    ("tgi", TGI, engines.EngineSignals(running=12, waiting=6, kv_cache_use=None)),  # TGI exports no KV-cache gauge
    ("sglang", SGLANG, engines.EngineSignals(running=9, waiting=2, kv_cache_use=0.28)),
    ("shipped", "serve_queue_depth 3\nserve_running_sequences 4\n", engines.EngineSignals(running=4, waiting=3)),
])
def test_each_engines_own_metrics_map_to_running_waiting_and_kv_cache_use(engine, text, expected):
    assert engines.read_metrics(engine, text) == expected


def test_an_engine_that_has_served_nothing_yet_reads_idle_and_garbage_is_an_error():
    assert engines.read_metrics("vllm", "# TYPE vllm:cache_config_info gauge\n") == engines.EngineSignals()
    # Another engine's names say nothing of this one.
    assert engines.read_metrics("tgi", SGLANG) == engines.EngineSignals()
    with pytest.raises(ValueError):
        engines.read_metrics("vllm", "vllm:num_requests_running{model_name=} three\n")


def test_engine_flags_come_from_named_settings_only():
    settings = engines.EngineSettings(max_model_len=4096, dtype="float16")
    command, args = engines.engine_command("vllm", model="org/name", port=8000, gpus=1, served_name="chat",
                                           settings=settings)
    assert command == ["vllm", "serve"] and args[0] == "org/name"
    assert args[args.index("--max-model-len") + 1] == "4096" and args[args.index("--dtype") + 1] == "float16"
    assert engines.dtypes("tgi") == ("auto", "float16", "bfloat16")
    with pytest.raises(ValueError, match="not a foreign engine"):
        engines.engine_command("shipped", model="m", port=8000, gpus=1, served_name="chat", settings=settings)


POLICY = autoscale.Policy(target_inflight=8, scale_in_after_s=30, idle_after_s=300, kv_cache_high=0.9)
BOUNDS = autoscale.Bounds(1, 4)


def _decide(history, at_s, *, inflight, kv, current=1, last_change_s=None):
    load = autoscale.Load(at_s=at_s, inflight=inflight, kv_cache_use=kv)
    return autoscale.decide(history, load, BOUNDS, POLICY, current=current, last_change_s=last_change_s)


def test_full_kv_caches_scale_out_after_two_samples_whatever_the_request_count():
    # Four long sequences in flight: half the in-flight target, but their KV caches are 95 % full.
    wanted, why, history = _decide([], 0, inflight=4, kv=0.95)
    assert wanted == 1 and why == ""  # one sample is not yet a trend
    wanted, why, history = _decide(history, 2, inflight=4, kv=0.95)
    assert wanted == 2 and "KV caches are 95% full" in why
    # Below the mark, the same load needs one replica, and scale-in waits its window as ever.
    wanted, why, history = _decide(history, 4, inflight=4, kv=0.5, current=2, last_change_s=2)
    assert (wanted, why) == (2, "")
    wanted, why, _ = _decide(history, 40, inflight=4, kv=0.5, current=2, last_change_s=2)
    assert wanted == 2  # no whole window of samples below the mark yet
    quiet = [{"at": at, "needed": 1} for at in range(10, 41, 2)]
    wanted, why, _ = _decide(quiet, 42, inflight=4, kv=0.5, current=2, last_change_s=2)
    assert wanted == 1 and why.startswith("Scale in")


def test_no_kv_reading_is_no_signal():
    history = []
    for at in (0, 2, 4):
        wanted, _why, history = _decide(history, at, inflight=4, kv=None)
    assert wanted == 1
