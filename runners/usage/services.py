"""Writes of the usage app that people make: budgets and cloud reference prices (staff only).

The ledger and the samples are written by the sweeps (``ledger``, ``sampling``), never by a request.
"""

from datetime import datetime
from decimal import Decimal

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.utils import timezone

from common.errors import Invalid
from quotas.models import ResourceFlavor
from quotas.services import require_staff
from runners.usage import ledger
from runners.usage.currencies import is_currency
from runners.usage.models import Budget, CloudPrice
from tenants.models import Tenant


def _check_currency(currency: str) -> None:
    if not is_currency(currency.upper()):
        raise Invalid("currency", f"{currency} is not an ISO 4217 currency code (USD, EUR, JPY, ...).")


def budget_set(*, actor: AbstractBaseUser, tenant: Tenant, monthly_amount: Decimal, currency: str,
               stop_borrowing: bool) -> Budget:
    """Set a tenant's monthly budget; the next settle checks it (and lifts or sets the borrowing pause)."""
    require_staff(actor)
    _check_currency(currency)
    budget, _ = Budget.objects.update_or_create(
        tenant=tenant,
        defaults={"monthly_amount": monthly_amount, "currency": currency.upper(), "stop_borrowing": stop_borrowing},
    )
    return budget


def budget_remove(*, actor: AbstractBaseUser, tenant: Tenant) -> bool:
    require_staff(actor)
    return bool(Budget.objects.filter(tenant=tenant).delete()[0])


def cloud_price_add(*, actor: AbstractBaseUser, flavor: ResourceFlavor, price_per_hour: Decimal, currency: str,
                    provider: str = "", effective_from: datetime | None = None) -> CloudPrice:
    """Add a cloud reference price from a moment on; earlier ones stay, so past usage keeps its reference."""
    require_staff(actor)
    _check_currency(currency)
    effective_from = effective_from or timezone.now()
    try:
        with transaction.atomic():
            price = CloudPrice.objects.create(flavor=flavor, price_per_hour=price_per_hour, currency=currency.upper(),
                                              provider=provider, effective_from=effective_from)
            ledger.reprice_from(flavor.id, effective_from)
            return price
    except IntegrityError:
        raise Invalid("effective_from", "This flavor already has a reference price starting at that moment.") from None
