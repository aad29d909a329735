"""Who: tenants, their members and roles. Environments (where their work runs) live in runners."""

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

# A DNS-1123 label (what Kubernetes accepts as a namespace name) without "--": tenant slugs and
# environment names never hold two hyphens in a row, so "--" can join them into a namespace.
DNS_LABEL_RE = r"^[a-z0-9]+(-[a-z0-9]+)*$"
DNS_LABEL_MESSAGE = (
    "Must be a DNS-1123 label without '--': lowercase letters and digits, with single '-' between them."
)
dns_label_validator = RegexValidator(DNS_LABEL_RE, DNS_LABEL_MESSAGE)
TENANT_SLUG_MAX = 30
ENVIRONMENT_NAME_MAX = 32
NAMESPACE_MAX = 63
NAMESPACE_SEPARATOR = "--"


def environment_namespace(tenant_slug: str, name: str) -> str:
    """The namespace of a tenant's environment: unique by construction.

    Neither part may hold "--" nor start or end with "-", so the one "--" in the
    result says where the slug ends: no two (tenant, name) pairs share a
    namespace, whatever either tenant names things.
    """
    return f"{tenant_slug}{NAMESPACE_SEPARATOR}{name}"


class Tenant(models.Model):
    slug = models.CharField(max_length=TENANT_SLUG_MAX, unique=True, validators=[dns_label_validator])
    name = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
    # Whether the scheduler may stop this tenant's preemptible jobs with a checkpoint and resume them on another
    # node to make room for a job that fits nowhere (runners.scheduling.defrag); a tenant admin turns it off.
    allow_moves = models.BooleanField(default=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer"
    MEMBER = "member"
    ADMIN = "admin"
    OWNER = "owner"


# Roles from least to most privileged: each holds every right of those before it.
ROLE_RANK = {role: rank for rank, role in enumerate(Role.values)}


def role_at_least(role: str | None, at_least: str) -> bool:
    """Whether a role (None for no membership) holds the rights of `at_least`: the one rank rule."""
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[at_least]


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="one_membership_per_user_and_tenant")]
        ordering = ["tenant__slug", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"

    def has_role(self, at_least: str) -> bool:
        return role_at_least(self.role, at_least)


class TokenInfo(models.Model):
    """What the portal keeps beside an API token (django-rest-knox stores only its hash and expiry):
    the name its owner gave it and when it was last used. Deleted with the token."""

    token = models.OneToOneField("knox.AuthToken", on_delete=models.CASCADE, related_name="info")
    name = models.CharField(max_length=100)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-token__created"]

    def __str__(self) -> str:
        return self.name
