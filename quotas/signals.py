"""What quotas announce to the apps above it, which subscribe (quotas imports none of them)."""

from django.dispatch import Signal

# Sent inside the transaction that created, changed, lowered or deleted a tenant's quota;
# keyword argument: tenant.
quota_changed = Signal()
