"""Pick the configured cluster backend."""

from functools import cache

from django.conf import settings

from runners.backends.base import ClusterBackend


@cache
def get_backend() -> ClusterBackend:
    """The backend named by CLUSTER_BACKEND, built once per process."""
    if settings.CLUSTER_BACKEND == "kubernetes":
        from runners.backends.kubernetes import KubernetesBackend

        return KubernetesBackend.from_settings()
    from runners.backends.local import LocalBackend

    return LocalBackend(
        workspace_dir=settings.LOCAL_WORKSPACE_DIR,
        provision_delay_s=settings.LOCAL_PROVISION_DELAY_S,
        cluster_file=settings.LOCAL_CLUSTER_FILE,
        use_nvml=settings.LOCAL_USE_NVML,
    )
