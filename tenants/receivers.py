"""What tenants answers of Django's own signals: a user deleted or deactivated loses what a removal takes.

A deleted user's memberships go with them (CASCADE) and a deactivated one keeps them, but in both
cases the person must lose the credentials handed to them as a member, as when an admin removes
them: each of their tenants announces `members_changed` and `member_removed` (inside the transaction
of the change; the receivers above act after commit). Re-activating a user announces
`members_changed`, so the re-sync gives their access back.
"""

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save, pre_delete, pre_save
from django.dispatch import receiver

from tenants.models import Membership, Tenant
from tenants.signals import member_removed, members_changed

User = get_user_model()


def _tenants_of(user) -> list[Tenant]:
    return list(Tenant.objects.filter(id__in=Membership.objects.filter(user=user).values("tenant_id")).order_by("id"))


def _announce_removed(user) -> None:
    for tenant in _tenants_of(user):
        members_changed.send(sender=Tenant, tenant=tenant)
        member_removed.send(sender=Tenant, tenant=tenant, username=user.get_username())


@receiver(pre_delete, sender=User, dispatch_uid="tenants-user-deleted")
def _user_deleted(sender, instance, **kwargs) -> None:
    # Before the delete: its memberships, which the cascade removes, still say where it belonged.
    _announce_removed(instance)


@receiver(pre_save, sender=User, dispatch_uid="tenants-user-activity-before")
def _user_saving(sender, instance, update_fields=None, **kwargs) -> None:
    if instance.pk is None or (update_fields is not None and "is_active" not in update_fields):
        instance._portal_was_active = None  # a new user, or a save that leaves is_active alone (a login)
        return
    instance._portal_was_active = User.objects.filter(pk=instance.pk).values_list("is_active", flat=True).first()


@receiver(post_save, sender=User, dispatch_uid="tenants-user-activity-after")
def _user_saved(sender, instance, created, **kwargs) -> None:
    was_active = getattr(instance, "_portal_was_active", None)
    if created or was_active is None or was_active == instance.is_active:
        return
    if instance.is_active:
        for tenant in _tenants_of(instance):
            members_changed.send(sender=Tenant, tenant=tenant)
    else:
        _announce_removed(instance)
