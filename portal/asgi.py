"""The portal's ASGI entry: the edge (runners/edge/), which serves endpoints and passes the rest to gunicorn.

``uvicorn portal.asgi:application`` serves /serve/... only; ``python -m runners.edge --upstream ...``
is how ``manage.py up`` and the Kubernetes Deployment run it.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()

from runners.edge.app import build  # noqa: E402

application = build(upstream=os.environ.get("EDGE_UPSTREAM") or None)
