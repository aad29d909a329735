"""gunicorn's settings for the portal's web process: `python -m gunicorn -c python:portal.gunicorn_conf portal.wsgi`.

Every value comes from the environment (listed in docs/configuration.md) with a default that suits one machine:

- where to listen: GUNICORN_BIND, else 0.0.0.0:$PORT when PORT is set (as platforms set it), else
  127.0.0.1:8000;
- gthread workers: GUNICORN_WORKERS processes (default two a CPU core plus one, at most 8), each with
  GUNICORN_THREADS threads (default 4), each thread its own database connection;
- GUNICORN_TIMEOUT_S: a request running longer has its worker killed and restarted (default 60);
  GUNICORN_GRACEFUL_TIMEOUT_S: on a restart or stop, how long requests in flight may still finish;
- GUNICORN_FORWARDED_ALLOW_IPS: the proxies whose X-Forwarded-* headers gunicorn trusts;
- GUNICORN_PRELOAD: the portal is imported once, in the master, and each worker is a fork of it (default on):
  Django's start-up is about a CPU-second, paid once instead of once a worker and again at every worker's
  replacement; no connection is opened at import, so none is shared across the fork;
- GUNICORN_MAX_REQUESTS: a worker is replaced after about this many requests (0: never), so a slow
  leak cannot grow without bound; each worker's count is offset by up to a tenth, so they do not all
  restart at once.

Logs go through the portal's logging (portal/logs.py, LOG_FORMAT), gunicorn's own lines included; the
access line of each request is RequestIdMiddleware's, with its request id and user. The root
filesystem may be read-only: the workers' heartbeat files are in /dev/shm (memory, never a disk
that could block them) and there is no control socket.
"""

import os

from portal.envconfig import env_bool, env_choice, env_int, env_str
from portal.logs import logging_config

# Read as settings read them, without importing them: this runs in gunicorn's master process, and only
# the workers load the portal (so a worker that fails to start is restarted, and the master stays up).
_debug = env_bool("DEBUG", True)

_port = env_str("PORT", "")
bind = env_str("GUNICORN_BIND", f"0.0.0.0:{_port}" if _port else "127.0.0.1:8000").split(",")

worker_class = "gthread"
workers = env_int("GUNICORN_WORKERS", min(2 * (os.cpu_count() or 1) + 1, 8), minimum=1)
threads = env_int("GUNICORN_THREADS", 4, minimum=1)
timeout = env_int("GUNICORN_TIMEOUT_S", 60, minimum=1)
graceful_timeout = env_int("GUNICORN_GRACEFUL_TIMEOUT_S", 30, minimum=0)
keepalive = env_int("GUNICORN_KEEPALIVE_S", 5, minimum=0)
preload_app = env_bool("GUNICORN_PRELOAD", True)
max_requests = env_int("GUNICORN_MAX_REQUESTS", 2000, minimum=0)
max_requests_jitter = max_requests // 10

worker_tmp_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
control_socket_disable = True
# Whose X-Forwarded-* headers gunicorn believes (comma-separated addresses or networks; * for any, where
# only the proxy can reach the pods). Django reads the scheme from SECURE_PROXY_SSL_HEADER either way.
forwarded_allow_ips = env_str("GUNICORN_FORWARDED_ALLOW_IPS", env_str("FORWARDED_ALLOW_IPS", "127.0.0.1,::1"))

accesslog = None
errorlog = "-"
_level = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))
loglevel = _level.lower()
logconfig_dict = logging_config(env_choice("LOG_FORMAT", "plain" if _debug else "json", ("json", "plain")), _level)
proc_name = "gpu-portal"
