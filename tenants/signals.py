"""What tenants announce to the apps above it, which subscribe (tenants imports none of them)."""

from django.dispatch import Signal

# Sent inside the transaction that added or removed a member; keyword argument: tenant.
members_changed = Signal()

# Sent inside the transaction that removed a member (or deleted or deactivated the user: tenants.receivers),
# after members_changed; keyword arguments: tenant,
# username. Whatever handed that person credentials of their own revokes them (after commit).
member_removed = Signal()
