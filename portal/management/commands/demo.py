"""Load the demo tenants and users; running it again changes nothing."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from quotas.models import PriceCard, Quota, ResourceFlavor
from runners.clusters.models import PartitionProfile
from runners.clusters.services import flavors_discover, inventory_sync
from runners.usage.models import Budget, CloudPrice
from tenants.models import Membership, Tenant

DEMO_PASSWORD = "portal-demo"
DEMO_USERS = [
    # username, staff, {tenant slug: role}
    ("admin", True, {}),
    ("alice", False, {"ml-research": "owner"}),
    ("bob", False, {"ml-research": "member", "vision": "viewer"}),
    ("carol", False, {"vision": "owner"}),
]
DEMO_TENANTS = [("ml-research", "ML Research"), ("vision", "Vision Lab")]
# name, kind, model, MIG profile, price per hour (USD)
DEMO_FLAVORS = [
    ("h100-80gb", "whole", "H100-80GB", "", "4.2000"),
    ("a100-40gb-3g.20gb", "mig", "A100-40GB", "3g.20gb", "1.1000"),
    ("a100-40gb-2g.10gb", "mig", "A100-40GB", "2g.10gb", "0.7500"),
    ("a100-40gb-1g.5gb", "mig", "A100-40GB", "1g.5gb", "0.4000"),
    ("t4-shared", "timeslice", "T4", "", "0.1500"),
]
# flavor, cloud reference price per unit-hour (USD): an on-demand price of the same GPU (a MIG slice
# or a time-slice share at its fraction of the GPU), for the "what the shared cluster saves" columns
DEMO_CLOUD_PRICES = [
    ("h100-80gb", "6.9800"), ("a100-40gb-3g.20gb", "1.5700"), ("a100-40gb-2g.10gb", "1.0500"),
    ("a100-40gb-1g.5gb", "0.5200"), ("t4-shared", "0.1400"),
]
# tenant, monthly budget (USD), stop borrowing past it
DEMO_BUDGETS = [("ml-research", "2000.00", False)]
# name, model, kind, layout, replicas
DEMO_PROFILES = [
    ("h100-whole", "H100-80GB", "whole", [], 1),
    ("h100-4g-3g", "H100-80GB", "mig", ["4g.40gb", "3g.40gb"], 1),
    ("h100-7x1g", "H100-80GB", "mig", ["1g.10gb"] * 7, 1),
    ("a100-mixed", "A100-40GB", "mig", ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"], 1),
    ("t4-share-4", "T4", "timeslice", [], 4),
]
# tenant, flavor, guaranteed, max
DEMO_QUOTAS = [
    ("ml-research", "h100-80gb", 8, 16),
    ("vision", "h100-80gb", 4, 12),
    ("vision", "a100-40gb-1g.5gb", 4, 8),
    ("ml-research", "t4-shared", 8, 32),
]


class Command(BaseCommand):
    help = "Create the demo staff user, two tenants and their members (idempotent)."

    @transaction.atomic
    def handle(self, *args, **options):
        users = get_user_model().objects
        tenants = {slug: Tenant.objects.get_or_create(slug=slug, defaults={"name": name})[0] for slug, name in DEMO_TENANTS}
        for username, staff, roles in DEMO_USERS:
            user, created = users.get_or_create(username=username, defaults={"is_staff": staff, "is_superuser": staff})
            if created:
                user.set_password(DEMO_PASSWORD)
                user.save()
            for slug, role in roles.items():
                Membership.objects.get_or_create(user=user, tenant=tenants[slug], defaults={"role": role})
        inventory_sync()
        flavors = {}
        for name, kind, model, profile, price in DEMO_FLAVORS:
            flavors[name], created = ResourceFlavor.objects.get_or_create(
                name=name, defaults={"kind": kind, "gpu_model": model, "mig_profile": profile}
            )
            if created:
                PriceCard.objects.create(flavor=flavors[name], price_per_hour=price, effective_from="2026-01-01T00:00Z")
        flavors_discover()  # anything else the demo cluster offers gets a flavor, unpriced
        for name, price in DEMO_CLOUD_PRICES:
            CloudPrice.objects.get_or_create(flavor=flavors[name], effective_from="2026-01-01T00:00Z",
                                             defaults={"price_per_hour": price, "provider": "on-demand list price"})
        for slug, amount, stop in DEMO_BUDGETS:
            Budget.objects.get_or_create(tenant=tenants[slug], defaults={"monthly_amount": amount, "stop_borrowing": stop})
        for name, model, kind, layout, replicas in DEMO_PROFILES:
            PartitionProfile.objects.get_or_create(
                name=name, defaults={"gpu_model": model, "kind": kind, "layout": layout, "replicas": replicas}
            )
        for slug, flavor, guaranteed, burst in DEMO_QUOTAS:
            Quota.objects.get_or_create(
                tenant=tenants[slug], flavor=flavors[flavor], defaults={"guaranteed": guaranteed, "max": burst}
            )
        self.stdout.write("Demo logins (password for all: %s):" % DEMO_PASSWORD)
        for username, staff, roles in DEMO_USERS:
            what = "staff, manages everything" if staff else ", ".join(f"{role} of {slug}" for slug, role in roles.items())
            self.stdout.write(f"  {username:<6} {what}")
