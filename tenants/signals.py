"""What tenants announce to the apps above it, which subscribe (tenants imports none of them)."""

from django.dispatch import Signal

# Sent inside the transaction that added or removed a member; keyword argument: tenant.
members_changed = Signal()

# Sent inside the transaction that removed a member (or deleted or deactivated the user: tenants.receivers),
# after members_changed; keyword arguments: tenant,
# username. Whatever handed that person credentials of their own revokes them (after commit).
member_removed = Signal()

# Sent inside the transaction of each change tenants makes (a tenant, a member, a token) for the audit
# log, which records it there; keyword arguments: those of audit.services.record after the action.
# A receiver that raises fails the change with it.
changed = Signal()


def audited(action: str, **details) -> None:
    """Announce a change for the audit log (send `changed`); refused when nothing would record it."""
    if not changed.has_listeners():
        raise RuntimeError("Nothing records the tenants' changes: the audit app is not installed.")
    changed.send(sender="tenants", action=action, **details)
