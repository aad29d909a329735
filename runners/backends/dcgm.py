"""GPU figures from NVIDIA's DCGM exporter, read through the Prometheus HTTP API: one query for a whole cluster.

The GPU Operator runs dcgm-exporter on every GPU node. With pod attribution on (the operator's
default) it labels each device's series with the `namespace`, `pod` and `container` the kubelet's
pod-resources API says hold the device, next to the device's own labels (`gpu`, `UUID`, `device`,
`modelName`, `Hostname`, and `GPU_I_PROFILE` / `GPU_I_ID` for a MIG instance). Prometheus scrapes
it with `honor_labels: true`, so those labels survive the scrape (without it, a scrape config that
labels targets with their own namespace and pod, as the usual ServiceMonitors do, renames the
exporter's to `exported_namespace` and `exported_pod`, and nothing here is attributed).

One instant query (`QUERY`) reads the four fields the portal shows, for every device a pod holds,
and when each device was scraped. An instant query stamps every answer with its evaluation time;
the sample's own time comes only from `timestamp()` of a plain selector, which drops the metric
name, so the four fields of one device would collide: `or` keeps the first of them per device, and
a label (`TIMESTAMP_LABEL`) tells those answers from the values. Being one query, the values and
the times come from one evaluation. The sample time is what lets the portal keep a reading once
when Prometheus has not scraped again since the last read.

A device is a GPU's UUID, or `<UUID>/<GPU_I_ID>` for a MIG instance. A MIG instance has no
DCGM_FI_DEV_GPU_UTIL (DCGM does not measure it below the whole GPU): its utilization is
DCGM_FI_PROF_GR_ENGINE_ACTIVE, a ratio, times 100. A time-sliced GPU is one device: whichever pod
the exporter names on it gets the whole GPU's figures.

No Django here, and nothing of the portal's pods: `runners.backends.kubernetes` attributes what
this reads to attempts.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from http.client import HTTPException
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode
from urllib.request import urlopen

from runners.backends.base import TransientBackendError
from runners.nvidia import names

# The exporter's fields (metric names) and the labels it puts on each series: NVIDIA's names, spelt
# in runners.nvidia.names.
GPU_UTIL = names.DCGM_GPU_UTIL
GR_ENGINE_ACTIVE = names.DCGM_GR_ENGINE_ACTIVE
FB_USED = names.DCGM_FB_USED
POWER_USAGE = names.DCGM_POWER_USAGE
FIELDS = (GPU_UTIL, GR_ENGINE_ACTIVE, FB_USED, POWER_USAGE)
UUID_LABEL = names.DCGM_UUID_LABEL
GPU_LABEL = names.DCGM_GPU_LABEL
MODEL_LABEL = names.DCGM_MODEL_LABEL
HOSTNAME_LABEL = names.DCGM_HOSTNAME_LABEL
MIG_PROFILE_LABEL = names.DCGM_MIG_PROFILE_LABEL
MIG_INSTANCE_LABEL = names.DCGM_MIG_INSTANCE_LABEL
# Kubernetes' attribution labels (the exporter's pod mapping).
NAMESPACE_LABEL = "namespace"
POD_LABEL = "pod"
CONTAINER_LABEL = "container"

# Marks the answers of QUERY that are sample times, not values.
TIMESTAMP_LABEL = "portal_timestamp"
_HELD = f'{POD_LABEL}!=""'  # series of a device some pod holds
_VALUES = f'{{__name__=~"{"|".join(FIELDS)}",{_HELD}}}'
_TIMES = " or ".join(f"timestamp({field}{{{_HELD}}})" for field in FIELDS)
QUERY = f'{_VALUES} or label_replace({_TIMES}, "{TIMESTAMP_LABEL}", "1", "", "")'

# A reading is worth little late: the next sampling pass reads again.
QUERY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DeviceReading:
    """One device's newest figures, as the exporter attributed it to one container of one pod."""

    namespace: str
    pod: str
    container: str
    device: str  # the GPU's UUID, or <UUID>/<GPU_I_ID> for a MIG instance
    gpu: str  # the GPU's index on its node
    model_name: str
    hostname: str
    mig_profile: str  # "" for a whole GPU
    at: float  # when Prometheus scraped it, seconds since the epoch
    gpu_util_pct: float | None = None
    memory_used_mib: float | None = None
    power_w: float | None = None


def query(url: str, expr: str, *, timeout_s: float = QUERY_TIMEOUT_S) -> tuple[float, list[dict]]:
    """One instant query: (its evaluation time, the vector's series); any failure is a TransientBackendError."""
    evaluated_at = time.time()
    address = f"{url.rstrip('/')}/api/v1/query?" + urlencode({"query": expr, "time": f"{evaluated_at:.3f}"})
    try:
        with urlopen(address, timeout=timeout_s) as answer:
            body = answer.read()
    except HTTPError as exc:
        detail = _json(exc.read()).get("error") or exc.reason
        raise TransientBackendError(f"Prometheus at {url} answered {exc.code} to a DCGM query: {detail}") from None
    except (URLError, OSError, HTTPException) as exc:
        # Refused, reset, timed out: Prometheus may be back by the next pass.
        raise TransientBackendError(f"Prometheus at {url} could not be reached: {exc}") from None
    answer = _json(body)
    data = answer.get("data") or {}
    if answer.get("status") != "success" or data.get("resultType") != "vector":
        raise TransientBackendError(f"Prometheus at {url} answered a DCGM query with {str(answer)[:300]}")
    return evaluated_at, data.get("result") or []


def read_devices(url: str, *, timeout_s: float = QUERY_TIMEOUT_S) -> list[DeviceReading]:
    """Every device some pod holds, with its newest figures, in one query."""
    evaluated_at, series = query(url, QUERY, timeout_s=timeout_s)
    return device_readings(series, evaluated_at=evaluated_at)


def device_readings(series: list[dict], *, evaluated_at: float) -> list[DeviceReading]:
    """QUERY's answer grouped by (namespace, pod, container, device); a device without a sample time gets evaluated_at."""
    labels_of: dict[tuple[str, str, str, str], dict[str, str]] = {}
    fields: dict[tuple[str, str, str, str], dict[str, float]] = {}
    times: dict[tuple[str, str, str, str], float] = {}
    for one in series:
        labels = one.get("metric") or {}
        if not labels.get(UUID_LABEL):
            continue
        key = _key(labels)
        _stamp, text = one.get("value") or (None, None)
        value = _figure(text)
        if labels.get(TIMESTAMP_LABEL):
            if value is not None:
                times[key] = value
            continue
        labels_of.setdefault(key, labels)
        if value is not None and labels.get("__name__") in FIELDS:
            fields.setdefault(key, {})[labels["__name__"]] = value
    readings = []
    for key, labels in labels_of.items():
        figures = fields.get(key, {})
        active = figures.get(GR_ENGINE_ACTIVE)
        busy = None if active is None else active * 100
        # A MIG instance's GPU_UTIL, should an exporter report one, would be the whole GPU's.
        util = busy if labels.get(MIG_INSTANCE_LABEL) else figures.get(GPU_UTIL, busy)
        namespace, pod, container, device = key
        readings.append(DeviceReading(
            namespace=namespace, pod=pod, container=container, device=device, gpu=labels.get(GPU_LABEL, ""),
            model_name=labels.get(MODEL_LABEL, ""), hostname=labels.get(HOSTNAME_LABEL, ""),
            mig_profile=labels.get(MIG_PROFILE_LABEL, ""), at=times.get(key, evaluated_at),
            gpu_util_pct=util, memory_used_mib=figures.get(FB_USED), power_w=figures.get(POWER_USAGE),
        ))
    return readings


def _key(labels: dict[str, str]) -> tuple[str, str, str, str]:
    device = labels[UUID_LABEL]
    if labels.get(MIG_INSTANCE_LABEL):
        device = f"{device}/{labels[MIG_INSTANCE_LABEL]}"
    return labels.get(NAMESPACE_LABEL, ""), labels.get(POD_LABEL, ""), labels.get(CONTAINER_LABEL, ""), device


def _figure(text) -> float | None:
    """A sample's value; NaN and infinities (nothing a gauge of these can mean) are None."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _json(data: bytes) -> dict:
    try:
        parsed = json.loads(data)
    except ValueError:
        return {"error": data[:300].decode(errors="replace")}
    return parsed if isinstance(parsed, dict) else {"error": str(parsed)[:300]}
