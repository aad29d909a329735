"""``python -m runners.edge [--bind HOST:PORT] [--upstream http://HOST:PORT]``: the edge, served by uvicorn.

``--upstream`` is the portal's web process (gunicorn): every request that is not /serve/... passes to
it, so the edge can stand in front on the portal's own port (``manage.py up`` runs it so). Without it,
only /serve/... is answered (the Kubernetes ingress sends only /serve/ to the edge).
"""

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.edge", description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default=os.environ.get("EDGE_BIND", "127.0.0.1:8000"), help="HOST:PORT")
    parser.add_argument("--upstream", default=os.environ.get("EDGE_UPSTREAM", ""),
                        help="the web process every other path passes to (http://HOST:PORT)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    import uvicorn
    from django.conf import settings

    from runners.edge.app import build

    host, _, port = args.bind.rpartition(":")
    app = build(upstream=args.upstream or None)
    # One process, one event loop: the edge holds no thread per request, so one is enough for many
    # thousands in flight; more edges (Kubernetes replicas) share nothing but the database. No
    # permessage-deflate on the WebSockets it passes through (a workspace's kernels and terminals): it would
    # compress every message on that one loop (a 4 MB image output, about 90 ms, while every other request
    # waits), for traffic that mostly stays inside the cluster.
    uvicorn.run(app, host=host.strip("[]") or "0.0.0.0", port=int(port), log_level="warning", access_log=False,
                proxy_headers=True, forwarded_allow_ips=os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1"),
                timeout_graceful_shutdown=10, timeout_keep_alive=settings.EDGE_KEEPALIVE_S, lifespan="on",
                ws="websockets-sansio", ws_per_message_deflate=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
