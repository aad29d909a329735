"""Which environment variables a tenant may put in a job's spec.

An allow-list by shape, then a table of refusals. A name must be upper-case letters,
digits and ``_``, not start with a digit, and be at most 128 characters (checked with
``fullmatch``: "X\\n", "lower" and "A-B" are refused). A name of that shape is allowed
unless a row of ``REFUSED`` matches it; each row says why. The variables a tenant may set
are for the tenant's own use (``MY_FLAG``, ``DATASET_SPLIT``): nothing the trainer, the
launcher, the interpreter, the math libraries or the host read may be steered this way,
since what the trainer does is decided by the job's spec alone and checked there.

Pure: no Django, no torch. ``runners.jobs`` asks ``refusal`` for every name of a spec, and
the local backend asks again before it starts a process.

``TRAINER_MIN_MEMORY_MIB`` lives here too, as the other half of "the spec alone decides what a
replica of the shipped trainer may use": the smallest ``memory_mib_per_replica`` the portal
accepts for the pytorch-ddp template.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

# The shipped trainer at its default settings (batch 32, seq_len 64), measured on CPU with
# torch 2.13 under the local backend's limit (RLIMIT_DATA = memory_mib_per_replica): its
# private writable memory peaks at 300 MiB with one OpenMP thread and 355 MiB with two, for 1,
# 2 or 4 replicas alike (resident: 340 MiB, of which 243 MiB anonymous). 512 leaves room for
# more threads (each thread's stack counts, 8 MiB) and a larger batch. The trainer refuses to
# start below it (a limit that small can hang torch.distributed's start-up instead of failing).
TRAINER_MIN_MEMORY_MIB = 512

NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")

_TRAINER = "the shipped trainer reads TRAIN_* as its settings; they come from the job's spec, as flags"
_LAUNCHER = "set by the launcher: the portal's bookkeeping and the replicas' rendezvous"
_INTERPRETER = "steers the Python interpreter, the C library or a shell: what gets loaded and run"
_LIBRARIES = "steers torch, the math libraries or the GPU stack: threads, memory, devices, caches, code generation"
_HOST = "the host's; the launcher sets it, inside the job's own folder where it is a path"
_CLUSTER = "the cluster's: set by Kubernetes for service discovery"

# (pattern, why it is refused), first match wins. A pattern is a name ("RANK"), a prefix
# ("TRAIN_*") or a suffix ("*_PROXY"), matched case-sensitively on a name of the allowed shape.
REFUSED: tuple[tuple[str, str], ...] = (
    ("TRAIN_*", _TRAINER),
    # The launcher's: torchrun's and torchelastic's names, and the portal's own.
    ("PORTAL_*", _LAUNCHER),
    ("RANK", _LAUNCHER),
    ("WORLD_SIZE", _LAUNCHER),
    ("LOCAL_RANK", _LAUNCHER),
    ("LOCAL_WORLD_SIZE", _LAUNCHER),
    ("MASTER_ADDR", _LAUNCHER),
    ("MASTER_PORT", _LAUNCHER),
    ("GROUP_RANK", _LAUNCHER),
    ("GROUP_WORLD_SIZE", _LAUNCHER),
    ("ROLE_*", _LAUNCHER),
    ("TORCHELASTIC_*", _LAUNCHER),
    # The interpreter, the dynamic loader and the C library (glibc's list of variables it
    # ignores in setuid programs, for the same reason), and shells' start-up hooks.
    ("PYTHON*", _INTERPRETER),
    ("LD_*", _INTERPRETER),
    ("GLIBC_*", _INTERPRETER),
    ("GCONV_*", _INTERPRETER),
    ("MALLOC_*", _INTERPRETER),
    ("GETCONF_DIR", _INTERPRETER),
    ("LOCPATH", _INTERPRETER),
    ("NLSPATH", _INTERPRETER),
    ("NIS_PATH", _INTERPRETER),
    ("HOSTALIASES", _INTERPRETER),
    ("LOCALDOMAIN", _INTERPRETER),
    ("RES_OPTIONS", _INTERPRETER),
    ("RESOLV_*", _INTERPRETER),
    ("BASH_ENV", _INTERPRETER),
    ("ENV", _INTERPRETER),
    ("SHELL", _INTERPRETER),
    ("SHELLOPTS", _INTERPRETER),
    ("BASHOPTS", _INTERPRETER),
    ("IFS", _INTERPRETER),
    ("PS4", _INTERPRETER),
    ("CDPATH", _INTERPRETER),
    # torch, its compilers and caches, the collectives, the GPU, the BLAS and OpenMP runtimes.
    ("TORCH*", _LIBRARIES),
    ("PYTORCH_*", _LIBRARIES),
    ("TRITON_*", _LIBRARIES),
    ("KINETO_*", _LIBRARIES),
    ("CUDA_*", _LIBRARIES),
    ("CUBLAS_*", _LIBRARIES),
    ("CUBLASLT_*", _LIBRARIES),
    ("CUDNN_*", _LIBRARIES),
    ("NCCL_*", _LIBRARIES),
    ("GLOO_*", _LIBRARIES),
    ("NVIDIA_*", _LIBRARIES),
    ("MKL_*", _LIBRARIES),
    ("MKLDNN_*", _LIBRARIES),
    ("DNNL_*", _LIBRARIES),
    ("ONEDNN_*", _LIBRARIES),
    ("OMP_*", _LIBRARIES),
    ("GOMP_*", _LIBRARIES),
    ("KMP_*", _LIBRARIES),
    ("OPENBLAS_*", _LIBRARIES),
    ("GOTO*", _LIBRARIES),
    ("BLIS_*", _LIBRARIES),
    ("NUMEXPR_*", _LIBRARIES),
    ("NUMPY_*", _LIBRARIES),
    # The host's: paths, locale, time zone, certificates, proxies, package tools.
    ("TMPDIR", _HOST),
    ("TMP", _HOST),
    ("TEMP", _HOST),
    ("HOME", _HOST),
    ("PATH", _HOST),
    ("USER", _HOST),
    ("LOGNAME", _HOST),
    ("PWD", _HOST),
    ("XDG_*", _HOST),
    ("HF_*", _HOST),
    ("PIP_*", _HOST),
    ("VIRTUAL_ENV", _HOST),
    ("CONDA_*", _HOST),
    ("LANG", _HOST),
    ("LANGUAGE", _HOST),
    ("LC_*", _HOST),
    ("TZ", _HOST),
    ("TZDIR", _HOST),
    ("SSL_*", _HOST),
    ("REQUESTS_CA_BUNDLE", _HOST),
    ("CURL_CA_BUNDLE", _HOST),
    ("*_PROXY", _HOST),
    ("KUBERNETES_*", _CLUSTER),
)


def refusal(name: str) -> str | None:
    """Why a tenant may not set `name` in a job, or None when it may."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return "not a variable name: upper-case letters, digits and _, not starting with a digit, at most 128 characters"
    for pattern, reason in REFUSED:
        if fnmatchcase(name, pattern):
            return f"{pattern}: {reason}"
    return None
