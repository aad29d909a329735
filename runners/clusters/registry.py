"""Pick the configured cluster backend and build it from the settings.

This is the Django side of `runners.backends`: the backends themselves take
plain arguments and never read settings, so they stay testable without Django.
"""

from functools import cache

from django.conf import settings
from django.utils.module_loading import import_string

from runners.backends.base import ClusterBackend


def kubernetes_backend_options() -> dict:
    """The Kubernetes backend's options from the KUBERNETES_* settings: their one set of defaults."""
    from runners.backends import k8s_inventory

    return dict(
        field_manager=settings.KUBERNETES_FIELD_MANAGER,
        username_template=settings.KUBERNETES_USERNAME_TEMPLATE,
        portal_namespace=settings.KUBERNETES_PORTAL_NAMESPACE,
        request_timeout_s=settings.KUBERNETES_REQUEST_TIMEOUT_S,
        gpu_operator_namespace=settings.KUBERNETES_GPU_OPERATOR_NAMESPACE,
        mig_parted_config_map=settings.KUBERNETES_MIG_PARTED_CONFIG_MAP,
        device_plugin_config_map=settings.KUBERNETES_DEVICE_PLUGIN_CONFIG_MAP,
        topology_labels=k8s_inventory.TopologyLabels(
            pool=settings.KUBERNETES_POOL_LABEL,
            rack=settings.KUBERNETES_RACK_LABEL,
            block=settings.KUBERNETES_BLOCK_LABEL,
            nvlink_domain=settings.KUBERNETES_NVLINK_DOMAIN_LABEL,
        ),
        scheduler_name=settings.KUBERNETES_SCHEDULER_NAME,
        trainer_image=settings.KUBERNETES_TRAINER_IMAGE,
        checkpoint_storage_class=settings.KUBERNETES_CHECKPOINT_STORAGE_CLASS,
        checkpoint_volume_size=settings.KUBERNETES_CHECKPOINT_VOLUME_SIZE,
        finished_job_ttl_s=settings.KUBERNETES_FINISHED_JOB_TTL_S,
        watch_timeout_s=settings.KUBERNETES_WATCH_TIMEOUT_S,
        node_lost_timeout_s=settings.KUBERNETES_NODE_LOST_TIMEOUT_S,
        member_accounts_namespace=settings.KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE,
        kubeconfig_server_url=settings.KUBECONFIG_SERVER_URL or None,
        kubeconfig_ca_file=settings.KUBECONFIG_CA_FILE or None,
        prometheus_url=settings.PROMETHEUS_URL or None,
        cache_agent_token=getattr(settings, "CACHE_AGENT_TOKEN", ""),
    )


def kubernetes_backend_from_settings():
    """A Kubernetes backend configured by the KUBERNETES_* settings."""
    from runners.backends.kubernetes import KubernetesBackend

    return KubernetesBackend.from_kubeconfig(
        in_cluster=settings.KUBERNETES_IN_CLUSTER, kubeconfig=settings.KUBECONFIG, **kubernetes_backend_options()
    )


@cache
def get_backend() -> ClusterBackend:
    """The backend named by CLUSTER_BACKEND (or made by CLUSTER_BACKEND_FACTORY), built once per process."""
    if settings.CLUSTER_BACKEND_FACTORY:
        return import_string(settings.CLUSTER_BACKEND_FACTORY)()
    if settings.CLUSTER_BACKEND == "kubernetes":
        return kubernetes_backend_from_settings()
    return local_backend_from_settings()


def local_backend_options() -> dict:
    """The local backend's options from the LOCAL_* settings."""
    return dict(
        workspace_dir=settings.LOCAL_WORKSPACE_DIR,
        provision_delay_s=settings.LOCAL_PROVISION_DELAY_S,
        cluster_file=settings.LOCAL_CLUSTER_FILE,
        use_nvml=settings.LOCAL_USE_NVML,
        jobs_dir=settings.LOCAL_JOBS_DIR,
        sandbox=settings.LOCAL_SANDBOX,
        bundle_storage_options=settings.BUNDLE_STORAGE_OPTIONS,
        node_caches=dict(
            data_storage_url=settings.DATA_STORAGE_URL, data_storage_options=settings.DATA_STORAGE_OPTIONS,
            node_cache_dir=getattr(settings, "NODE_CACHE_DIR", None) or None,
            node_cache_bytes=getattr(settings, "NODE_CACHE_BYTES", 20 * 1024**3),
        ),
    )


def local_backend_from_settings():
    """A local backend configured by the LOCAL_* settings."""
    from runners.backends.local import LocalBackend

    return LocalBackend(**local_backend_options())
