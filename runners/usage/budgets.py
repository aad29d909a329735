"""Monthly budgets: alerts at 80% and 100% (mail, a banner, an event in the API) and, if asked, no borrowing past it."""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from quotas.models import BorrowingPause
from runners.usage import ledger
from runners.usage.models import Budget, BudgetAlert
from runners.usage.selectors import tenant_month_cost
from tenants.models import Membership, Role

logger = logging.getLogger(__name__)

THRESHOLDS = (80, 100)
PAUSE_REASON = "The tenant's monthly budget is spent: only work within its guarantee is admitted until the month ends."


def _recipients(tenant) -> list[str]:
    return sorted({
        membership.user.email for membership in Membership.objects.filter(
            tenant=tenant, role__in=[Role.OWNER, Role.ADMIN]
        ).select_related("user") if membership.user.email
    })


def budgets_check(now: datetime | None = None) -> int:
    """Compare every tenant's month with its budget: record and mail a crossed threshold once, pause borrowing."""
    now = now or timezone.now()
    month = ledger.utc_day(now).replace(day=1)
    created = 0
    for budget in Budget.objects.select_related("tenant"):
        spent = tenant_month_cost(budget.tenant, budget.currency, now=now)
        share = spent * 100 / budget.monthly_amount if budget.monthly_amount else (100 if spent > 0 else 0)
        for threshold in THRESHOLDS:
            if share < threshold:
                continue
            with transaction.atomic():
                alert, fresh = BudgetAlert.objects.get_or_create(
                    tenant=budget.tenant, month=month, threshold=threshold,
                    defaults={"spent": spent.quantize(ledger.CENT), "budget": budget.monthly_amount,
                              "currency": budget.currency},
                )
                if fresh:
                    created += 1
                    transaction.on_commit(lambda alert=alert: _mail(alert))
        over = budget.stop_borrowing and share >= 100
        if over:
            BorrowingPause.objects.get_or_create(tenant=budget.tenant, defaults={"reason": PAUSE_REASON})
        else:
            BorrowingPause.objects.filter(tenant=budget.tenant, reason=PAUSE_REASON).delete()
    # A budget removed, or switched to not stopping, lifts the pause it had set.
    BorrowingPause.objects.filter(reason=PAUSE_REASON).exclude(
        tenant__budget__stop_borrowing=True
    ).delete()
    return created


def _mail(alert: BudgetAlert) -> None:
    recipients = _recipients(alert.tenant)
    if not recipients:
        return
    subject = f"[GPU portal] {alert.tenant.slug} has used {alert.threshold}% of its monthly budget"
    body = (
        f"Tenant {alert.tenant.slug} has spent {alert.spent} {alert.currency} of its monthly budget of "
        f"{alert.budget} {alert.currency} ({alert.month:%B %Y}).\n"
    )
    if alert.threshold >= 100 and Budget.objects.filter(tenant=alert.tenant, stop_borrowing=True).exists():
        body += "\n" + PAUSE_REASON + "\n"
    try:
        send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, recipients)
    except Exception as exc:  # SMTP down: the alert stands (banner, API); the mail is not retried
        logger.error("Could not mail the budget alert for %s: %s", alert.tenant.slug, exc)
        return
    BudgetAlert.objects.filter(id=alert.id).update(mailed_to=recipients)
