#!/usr/bin/env python
"""Django's command-line utility for the GPU portal."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    # With DATABASE_URL or CELERY_BROKER_URL unset, every command (`up`, `shell`, `migrate`, `demo`...)
    # reaches this checkout's embedded PostgreSQL and Redis under var/, starting them when they are down.
    from portal.embedded import use_for_this_process

    use_for_this_process()
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
