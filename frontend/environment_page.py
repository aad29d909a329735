"""What the environment page shows besides the environment: how to connect, its work, the tenant's quota, its history."""

from pathlib import Path

from django.conf import settings

from quotas import selectors as quota_selectors
from runners.environments import selectors as environment_selectors
from runners.environments.models import Environment, EnvironmentState
from runners.jobs import selectors as job_selectors
from runners.jobs.models import Job
from tenants import selectors as tenant_selectors

# The environment's jobs and endpoints listed on its page, newest first.
PAGE_ROWS = 50


def environment_page(environment: Environment, user) -> dict:
    """The page's context beyond the environment and the caller's abilities (the view checked visibility)."""
    usage = job_selectors.tenant_flavor_usage(tenant=environment.tenant)
    quotas = [
        {"quota": quota, "in_use": usage.get(quota.flavor_id, 0)}
        for quota in quota_selectors.tenant_quotas(tenant=environment.tenant)
    ]
    membership = tenant_selectors.membership_get(user=user, tenant=environment.tenant)
    context = {
        "gone": environment.state == EnvironmentState.DELETED,
        "ready": environment.state == EnvironmentState.READY,
        "on_kubernetes": environment.backend == "kubernetes",
        # A kubeconfig is for members (staff who are not one see how, but get no download).
        "is_member": membership is not None,
        # The rights the kubeconfig carries: the membership's own role (the page's abilities count staff as owners).
        "member_role": membership.role if membership else None,
        "token_ttl_minutes": settings.KUBECONFIG_TOKEN_TTL_S // 60,
        "jobs": list(environment.jobs.filter(kind=Job.Kind.TRAINING).order_by("-submitted_at", "-id")[:PAGE_ROWS]),
        "endpoints": list(environment.endpoints.order_by("name")[:PAGE_ROWS]),
        "quotas": quotas,
        "history": environment_selectors.environment_history(environment),
    }
    if environment.backend == "local":
        context["workspace"] = Path(settings.LOCAL_WORKSPACE_DIR) / environment.namespace
    return context
