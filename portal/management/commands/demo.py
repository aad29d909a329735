"""Load the demo tenants and users; running it again changes nothing."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

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
        self.stdout.write("Demo logins (password for all: %s):" % DEMO_PASSWORD)
        for username, staff, roles in DEMO_USERS:
            what = "staff, manages everything" if staff else ", ".join(f"{role} of {slug}" for slug, role in roles.items())
            self.stdout.write(f"  {username:<6} {what}")
