"""manage.py audit_verify: read the audit log in order and check its hash chain; exits 1 naming each entry
missing before another (a gap) or at the end, changed or forged, 0 when the chain holds."""

from django.core.management.base import BaseCommand, CommandError

from audit.chain import HASHED_FIELDS, chain_problems
from audit.models import AuditChainHead, AuditEntry


class Command(BaseCommand):
    help = "Check the audit log's hash chain: a gap, a changed or a forged entry is an error (exit 1)."

    def handle(self, *args, **options):
        head = AuditChainHead.objects.filter(id=1).values_list("hash", flat=True).first() or ""
        rows = AuditEntry.objects.order_by("id").values(*HASHED_FIELDS, "hash")
        count = 0

        def counted():
            nonlocal count
            for row in rows.iterator(chunk_size=2000):
                count += 1
                yield row

        problems = chain_problems(counted(), head)
        if problems:
            shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
            raise CommandError(f"The audit log's chain is broken ({len(problems)} problems in {count} entries):\n"
                               + "\n".join(shown))
        self.stdout.write(f"The audit log's chain holds: {count} entries.")
