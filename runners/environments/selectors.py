"""Reads of environments: a user sees those of the tenants they belong to (staff all); anyone else's is NotFound."""


from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from common.errors import NotFound
from runners.environments.models import Environment, EnvironmentState
from tenants.models import Tenant
from tenants.selectors import tenant_list


def environment_list(
    *, user: AbstractBaseUser, tenant: Tenant | None = None, state: str | None = None, include_deleted: bool = False
) -> QuerySet[Environment]:
    """Environments of the user's tenants, newest first."""
    queryset = Environment.objects.filter(tenant__in=tenant_list(user=user)).select_related("tenant", "created_by")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    if state is not None:
        queryset = queryset.filter(state=state)
    elif not include_deleted:
        queryset = queryset.exclude(state=EnvironmentState.DELETED)
    return queryset.order_by("-created_at", "-id")


def environment_get(*, user: AbstractBaseUser, environment_id: int) -> Environment:
    try:
        return environment_list(user=user, include_deleted=True).get(id=environment_id)
    except (Environment.DoesNotExist, ValueError):
        raise NotFound("No such environment.") from None


def environment_history(environment: Environment) -> list[dict]:
    """What the environment's row tells of its life, oldest first: there is no event table, so this is
    its creation, the last state it reached (with its message: a failure's reason) and the delete request."""
    history = [{"at": environment.created_at, "what": "Created",
                "detail": f"by {environment.created_by.get_username()}" if environment.created_by else ""}]
    if environment.delete_requested_at:
        history.append({"at": environment.delete_requested_at, "what": "Delete requested", "detail": ""})
    if environment.state != EnvironmentState.REQUESTED:
        history.append({"at": environment.state_changed_at, "what": environment.get_state_display().capitalize(),
                        "detail": environment.status_message})
    return sorted(history, key=lambda entry: entry["at"])
