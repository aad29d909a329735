"""Which variables a tenant may set in a job: a shape, then a table of refusals with their reasons."""

import pytest

from runners.workloads import env_policy
from runners.workloads.env_policy import REFUSED, refusal

pytestmark = pytest.mark.unit

# One name for every row of the table, each expected to be refused by that very row.
EXAMPLES = {
    "TRAIN_*": "TRAIN_KEEP_CHECKPOINTS",
    "PORTAL_*": "PORTAL_ATTEMPT",
    "RANK": "RANK",
    "WORLD_SIZE": "WORLD_SIZE",
    "LOCAL_RANK": "LOCAL_RANK",
    "LOCAL_WORLD_SIZE": "LOCAL_WORLD_SIZE",
    "MASTER_ADDR": "MASTER_ADDR",
    "MASTER_PORT": "MASTER_PORT",
    "GROUP_RANK": "GROUP_RANK",
    "GROUP_WORLD_SIZE": "GROUP_WORLD_SIZE",
    "ROLE_*": "ROLE_RANK",
    "TORCHELASTIC_*": "TORCHELASTIC_RESTART_COUNT",
    "PYTHON*": "PYTHONPATH",
    "LD_*": "LD_PRELOAD",
    "GLIBC_*": "GLIBC_TUNABLES",
    "GCONV_*": "GCONV_PATH",
    "MALLOC_*": "MALLOC_ARENA_MAX",
    "GETCONF_DIR": "GETCONF_DIR",
    "LOCPATH": "LOCPATH",
    "NLSPATH": "NLSPATH",
    "NIS_PATH": "NIS_PATH",
    "HOSTALIASES": "HOSTALIASES",
    "LOCALDOMAIN": "LOCALDOMAIN",
    "RES_OPTIONS": "RES_OPTIONS",
    "RESOLV_*": "RESOLV_HOST_CONF",
    "BASH_ENV": "BASH_ENV",
    "ENV": "ENV",
    "SHELL": "SHELL",
    "SHELLOPTS": "SHELLOPTS",
    "BASHOPTS": "BASHOPTS",
    "IFS": "IFS",
    "PS4": "PS4",
    "CDPATH": "CDPATH",
    "TORCH*": "TORCHINDUCTOR_CACHE_DIR",
    "PYTORCH_*": "PYTORCH_CUDA_ALLOC_CONF",
    "TRITON_*": "TRITON_CACHE_DIR",
    "KINETO_*": "KINETO_LOG_LEVEL",
    "CUDA_*": "CUDA_VISIBLE_DEVICES",
    "CUBLAS_*": "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_*": "CUBLASLT_LOG_LEVEL",
    "CUDNN_*": "CUDNN_LOGINFO_DBG",
    "NCCL_*": "NCCL_SOCKET_IFNAME",
    "GLOO_*": "GLOO_SOCKET_IFNAME",
    "NVIDIA_*": "NVIDIA_VISIBLE_DEVICES",
    "MKL_*": "MKL_NUM_THREADS",
    "MKLDNN_*": "MKLDNN_VERBOSE",
    "DNNL_*": "DNNL_VERBOSE",
    "ONEDNN_*": "ONEDNN_VERBOSE",
    "OMP_*": "OMP_NUM_THREADS",
    "GOMP_*": "GOMP_SPINCOUNT",
    "KMP_*": "KMP_AFFINITY",
    "OPENBLAS_*": "OPENBLAS_NUM_THREADS",
    "GOTO*": "GOTO_NUM_THREADS",
    "BLIS_*": "BLIS_NUM_THREADS",
    "NUMEXPR_*": "NUMEXPR_MAX_THREADS",
    "NUMPY_*": "NUMPY_MADVISE_HUGEPAGE",
    "TMPDIR": "TMPDIR",
    "TMP": "TMP",
    "TEMP": "TEMP",
    "HOME": "HOME",
    "PATH": "PATH",
    "USER": "USER",
    "LOGNAME": "LOGNAME",
    "PWD": "PWD",
    "XDG_*": "XDG_CACHE_HOME",
    "HF_*": "HF_HOME",
    "PIP_*": "PIP_INDEX_URL",
    "VIRTUAL_ENV": "VIRTUAL_ENV",
    "CONDA_*": "CONDA_PREFIX",
    "LANG": "LANG",
    "LANGUAGE": "LANGUAGE",
    "LC_*": "LC_ALL",
    "TZ": "TZ",
    "TZDIR": "TZDIR",
    "SSL_*": "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE": "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE": "CURL_CA_BUNDLE",
    "*_PROXY": "HTTPS_PROXY",
    "KUBERNETES_*": "KUBERNETES_SERVICE_HOST",
}


def test_every_row_of_the_table_has_an_example_here():
    assert set(EXAMPLES) == {pattern for pattern, _ in REFUSED}
    assert len(REFUSED) == len(EXAMPLES), "a pattern appears twice in the table"


@pytest.mark.parametrize(("pattern", "name"), sorted(EXAMPLES.items()))
def test_each_refused_pattern_refuses_with_its_reason(pattern, name):
    reason = dict(REFUSED)[pattern]
    assert refusal(name) == f"{pattern}: {reason}"


@pytest.mark.parametrize(
    "name",
    ["TRAIN_BATCH_SIZE", "TRAIN_LR", "TORCH_HOME", "TORCH_LOGS", "TORCHDYNAMO_DISABLE", "HTTP_PROXY", "NO_PROXY",
     "ALL_PROXY", "LC_CTYPE", "MASTER_ADDR", "PYTHONSTARTUP", "LD_LIBRARY_PATH", "LD_AUDIT", "GOTOBLAS_MAIN_FREE",
     "KUBERNETES_PORT", "ROLE_WORLD_SIZE", "MALLOC_TRACE"],
)
def test_the_names_of_the_issue_and_their_relatives_are_refused(name):
    assert refusal(name) is not None


@pytest.mark.parametrize(
    "name",
    ["MY_FLAG", "DATASET_SPLIT", "WANDB_MODE", "X", "_PRIVATE", "A1", "RANKING", "TRAINER_NOTE", "LDAP_HOST",
     "PATHS", "HOMEPAGE", "TEMPERATURE", "A" * 128],
)
def test_a_name_of_the_tenants_own_is_allowed(name):
    assert refusal(name) is None


@pytest.mark.parametrize(
    "name",
    ["X\n", "MY_FLAG\n", "\nX", "my_flag", "My_Flag", "A-B", "A B", "A.B", "1A", "", "A" * 129, "É", "A\x00",
     "X\r", "ＡＢ"],
)
def test_a_name_of_any_other_shape_is_refused(name):
    assert refusal(name).startswith("not a variable name")


def test_the_trainers_memory_floor_is_set_down_here_for_the_spec_check():
    assert 256 <= env_policy.TRAINER_MIN_MEMORY_MIB <= 1024
