"""Mail with real Celery workers and a real SMTP server on loopback: a worker killed between its claim on an
event's mail and the mail itself leaves the claim to run out, then the mail goes, once."""

import time

import pytest

from runners.notifications import services
from runners.notifications.models import Event
from tests.notifications.hooks import SmtpReceiver
from tests.notifications.test_worker import _finish_a_job, cluster  # noqa: F401 (a fixture)
from tests.support.worker import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def test_mail_whose_worker_died_after_its_claim_is_sent_once_the_claim_runs_out(
    cluster, celery_worker_factory, tenant, owner, teammate  # noqa: F811
):
    for user in (owner, teammate):  # both are mailed a failed job by default
        user.email = f"{user.username}@example.test"
        user.save()
    with SmtpReceiver(hold_first=True) as smtp:
        env = dict(EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend", EMAIL_HOST="127.0.0.1",
                   EMAIL_PORT=smtp.port, EMAIL_TIMEOUT=120, NOTIFY_MAIL_CLAIM_S=3,
                   CELERY_VISIBILITY_TIMEOUT_S=2, CELERY_UNACKED_RESTORE_INTERVAL_S=1)
        first = celery_worker_factory(**env)
        _finish_a_job(cluster, owner, outcome="failed")
        wait_for(smtp.held.is_set, timeout_s=60, message="the first worker to connect to the mail server")
        first.kill()  # between its claim and the mail: it never finishes
        event = Event.objects.get()
        assert event.email_attempts == 0 and not event.email_error and smtp.messages == []

        second = celery_worker_factory(**env)
        deadline = time.monotonic() + 120
        while len(smtp.messages) < 2 and time.monotonic() < deadline:
            services.deliveries_sweep()  # what the beat does every SWEEP_INTERVAL_S
            time.sleep(1)
        assert sorted(r for recipients, _ in smtp.messages for r in recipients) == [
            "olivia@example.test", "tom@example.test"], smtp.messages
        event.refresh_from_db()
        assert event.emailed_at is not None and event.email_attempts == 0
        services.deliveries_sweep()
        second.stop()  # a warm shutdown: whatever it had started is finished
        assert len(smtp.messages) == 2, "mailed once"
