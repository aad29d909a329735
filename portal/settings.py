"""Settings for the GPU portal, all driven by environment variables.

One database engine and one broker everywhere: PostgreSQL (``DATABASE_URL``) and Redis
(``CELERY_BROKER_URL``). Production and the tests name them; a checkout that names neither gets
embedded ones under ``var/``, started by ``manage.py`` (portal/embedded.py) before these settings load.
With nothing else set, the portal runs on one machine with the local cluster backend and a demo
secret key. Every variable is listed in docs/configuration.md.
"""

import re
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from portal.envconfig import (
    env_bool,
    env_choice,
    env_decimal,
    env_float,
    env_int,
    env_json_object,
    env_list,
    env_str,
    env_url,
)
from portal.logs import init_sentry, logging_config
from runners.scheduler.admission.cycle import DEFAULT_GRACE_PERIOD_S

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("PORTAL_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DEBUG", True)
_DEMO_SECRET_KEY = "insecure-demo-key-only-for-local-runs-with-debug-on"
SECRET_KEY = env_str("SECRET_KEY", _DEMO_SECRET_KEY if DEBUG else "")
if not SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off; generate one with `python -c 'import secrets; print(secrets.token_urlsafe(50))'`.")
if not DEBUG and SECRET_KEY == _DEMO_SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY is the demo key; set a real one when DEBUG is off.")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc served from here: /api/docs/ works offline
    "django_celery_beat",
    "portal",
    "tenants",
    "quotas",
    "runners",  # the migration history from before the apps below were split out of it
    "runners.bundles",
    "runners.datasets",
    "runners.clusters",
    "runners.environments",
    "runners.jobs",
    "runners.scheduling",
    "runners.registry",
    "runners.inference",
    "runners.workspaces",
    "runners.nodecache",
    "runners.usage",
    "runners.notifications",
    "audit",
    "frontend",
]

CSRF_FAILURE_VIEW = "portal.middleware.csrf_failure"

MIDDLEWARE = [
    # First: the request's id (X-Request-ID, in every log line) and its access line, for every answer.
    "portal.middleware.RequestIdMiddleware",
    # A body over REQUEST_MAX_BODY_BYTES is a 413, before anything reads it.
    "portal.middleware.BodySizeLimitMiddleware",
    # Then refuse control characters in headers, path and query before anything looks them up.
    "portal.middleware.RequestHygieneMiddleware",
    "portal.db_errors.DatabaseUnavailableMiddleware",  # a database connection lost mid-request: 503, not 500
    "portal.middleware.DegradedSendMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files in every mode (gunicorn serves the portal in every mode, and does not serve them).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "portal.middleware.ContentSecurityPolicyMiddleware",
    # Last, so it sees what a view raised: common.errors.NotFound is a 404 page, Conflict a 409.
    "portal.middleware.PortalErrorMiddleware",
]

# Scripts, styles, images and fonts from the portal itself (styles may also be inline: charts set widths
# in style attributes); no plugins, no framing, forms post only here. Empty turns the header off.
CONTENT_SECURITY_POLICY = env_str(
    "CONTENT_SECURITY_POLICY",
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
    "frame-ancestors 'none'",
)

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

def _required_url(name: str, schemes: tuple[str, ...], what: str) -> str:
    """A server's URL; unset, say how to get one instead of falling back to anything else."""
    if not env_str(name, ""):
        raise ImproperlyConfigured(
            f"{name} is not set: name your {what} server ({schemes[0]}://...). `python manage.py` and "
            "`make run` start an embedded one under var/ when it is unset and DEBUG is on (portal/embedded.py)."
        )
    return env_url(name, "", schemes=schemes)


DATABASE_URL = _required_url("DATABASE_URL", ("postgres", "postgresql", "pgsql"), "PostgreSQL")
# Set only where migrations run (the migrate Job): the URL of the role that owns the tables, used instead
# of DATABASE_URL, so the role the portal runs as owns none (it cannot empty or unhook the audit log).
if env_str("MIGRATE_DATABASE_URL", ""):
    DATABASE_URL = env_url("MIGRATE_DATABASE_URL", "", schemes=("postgres", "postgresql", "pgsql"))
# The role the portal runs as (DATABASE_URL's user) when migrations run as the owner: after `migrate`
# it is granted what the portal needs, and on the audit log only to read and add (audit.roles).
DATABASE_APP_ROLE = env_str("DATABASE_APP_ROLE", "")
try:
    DATABASES = {"default": environ.Env.db_url_config(DATABASE_URL)}
except Exception as exc:  # django-environ raises several types for a bad URL.
    raise ImproperlyConfigured(f"DATABASE_URL={DATABASE_URL!r} could not be parsed: {exc}") from None
DATABASES["default"]["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE_S", 60, minimum=0)
# A kept connection is checked before a request (or task) reuses it: one the server dropped
# meanwhile (a restart, a failover, an idle timeout) is replaced instead of failing the request.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# The database pytest creates; name it per checkout when several test runs share one server.
if _raw_test_db := env_str("TEST_DATABASE_NAME", ""):
    DATABASES["default"]["TEST"] = {"NAME": _raw_test_db}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}
# With DEBUG on, WhiteNoise serves the apps' static folders as they are (no collectstatic), and picks up
# edits; off, it serves what collectstatic wrote to STATIC_ROOT. Set from DEBUG here, not left to
# WhiteNoise, which would read DEBUG when the middleware starts (tests turn it off by then).
WHITENOISE_USE_FINDERS = DEBUG
WHITENOISE_AUTOREFRESH = DEBUG

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

# Production hardening: everything `manage.py check --deploy` asks for, on
# whenever DEBUG is off. SECURE_SSL_REDIRECT can be turned off behind a proxy
# that already redirects.
if not DEBUG:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
# No script reads either cookie (the pages send the CSRF token from the form), and neither goes along
# on another site's cross-site POST. Django's defaults already say Lax; set here so it stays said.
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"

# Rows a page of an API list holds unless ?page_size= asks otherwise (which may ask for up to 200,
# common.pagination.MAX_PAGE_SIZE; this default may not be more).
API_PAGE_SIZE = env_int("API_PAGE_SIZE", 50, minimum=1)
if API_PAGE_SIZE > 200:
    raise ImproperlyConfigured(f"API_PAGE_SIZE={API_PAGE_SIZE} must be at most 200, the largest page any list serves.")

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # ?page= must be a positive integer (400 naming it otherwise); past the last page is a 404.
    "DEFAULT_PAGINATION_CLASS": "common.pagination.PageNumberPagination",
    "PAGE_SIZE": API_PAGE_SIZE,
    # Documents every error answer, with its body, next to the success one (portal/schema.py).
    "DEFAULT_SCHEMA_CLASS": "portal.schema.PortalAutoSchema",
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    # JSON only, with size and nesting bounded (portal/parsers.py).
    "DEFAULT_PARSER_CLASSES": ["common.parsers.BoundedJSONParser"],
    "EXCEPTION_HANDLER": "portal.api.exception_handler",
    "NUM_PROXIES": env_int("NUM_PROXIES", 0, minimum=0),
}

from datetime import timedelta  # noqa: E402

# Bounds on an API request body: its size in bytes and how deep its JSON may nest.
API_MAX_BODY_BYTES = env_int("API_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)
API_MAX_JSON_DEPTH = env_int("API_MAX_JSON_DEPTH", 32, minimum=2)
# Bounds on every request, pages and the admin included: a body over REQUEST_MAX_BODY_BYTES (by its
# Content-Length) is a 413 before it is read (portal.middleware.BodySizeLimitMiddleware); Django's own
# limits, on what a form or query string may hold, are the same size, and REQUEST_MAX_FIELDS fields.
REQUEST_MAX_BODY_BYTES = env_int("REQUEST_MAX_BODY_BYTES", API_MAX_BODY_BYTES, minimum=1024)
if API_MAX_BODY_BYTES > REQUEST_MAX_BODY_BYTES:
    raise ImproperlyConfigured(
        f"API_MAX_BODY_BYTES={API_MAX_BODY_BYTES} is over REQUEST_MAX_BODY_BYTES={REQUEST_MAX_BODY_BYTES}; "
        "the API's bodies are requests too: raise REQUEST_MAX_BODY_BYTES or lower API_MAX_BODY_BYTES."
    )
DATA_UPLOAD_MAX_MEMORY_SIZE = REQUEST_MAX_BODY_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = REQUEST_MAX_BODY_BYTES
DATA_UPLOAD_MAX_NUMBER_FIELDS = env_int("REQUEST_MAX_FIELDS", 1000, minimum=10)

# Login attempts allowed per client address, and per username, e.g. 30/min.
API_LOGIN_RATE = env_str("API_LOGIN_RATE", "30/min")
if not re.fullmatch(r"\d+/(s|sec|m|min|h|hour|d|day)", API_LOGIN_RATE):
    raise ImproperlyConfigured(f"API_LOGIN_RATE={API_LOGIN_RATE!r} must look like 30/min (per s, min, hour or day).")

# Celery's broker: Redis, the same server in `make run`, the tests and production.
CELERY_BROKER_URL = _required_url("CELERY_BROKER_URL", ("redis", "rediss"), "Redis")

# The cache holds login counters, which every web process must share: by default the broker's Redis.
CACHE_URL = env_url("CACHE_URL", CELERY_BROKER_URL, schemes=("redis", "rediss"))
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": CACHE_URL,
                      "KEY_PREFIX": env_str("CACHE_KEY_PREFIX", "portal")}}

REST_KNOX = {
    "TOKEN_TTL": timedelta(hours=env_int("API_TOKEN_TTL_HOURS", 24 * 30, minimum=1)),
    "AUTH_HEADER_PREFIX": "Token",
    "AUTO_REFRESH": False,
}
# A bearer token Prometheus may scrape /metrics with (besides a staff user's API token); empty: none.
METRICS_SCRAPE_TOKEN = env_str("METRICS_SCRAPE_TOKEN", "")

SPECTACULAR_SETTINGS = {
    "TITLE": "GPU portal API",
    "DESCRIPTION": "Self-service GPU environments, jobs, quotas and partitions for shared clusters.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {"PartitionKindEnum": "quotas.models.PartitionKind",
                            "DatasetVersionStateEnum": "runners.datasets.models.VersionState"},
    # The docs pages load Swagger UI from the portal's own static files, never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Celery.
# One queue name per deployment (tests use a fresh one per run, so runs never see each other's messages).
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE", "portal")


def unacked_keys(queue: str) -> dict[str, str]:
    """The Redis keys a queue's workers keep their unacknowledged messages, their index and the restore lock under
    (kombu's transport options). Kombu's own names are the same for every queue of a database; named after the
    queue, two deployments (or two test processes) sharing a database neither restore each other's messages on
    their own visibility timeout nor wait on a lock that a killed worker of the other left behind."""
    return {f"unacked{part}_key": f"{queue}.unacked{part}" for part in ("", "_index", "_mutex")}


CELERY_BROKER_TRANSPORT_OPTIONS: dict = {
    # How long an unacknowledged message waits before Redis hands it to another
    # worker; this is how a task whose worker died is redelivered.
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT_S", 300, minimum=1),
    # How often each worker looks for such messages (one cheap Redis query).
    "unacked_restore_interval": env_int("CELERY_UNACKED_RESTORE_INTERVAL_S", 10, minimum=1),
    "unacked_restore_throttle": 1,
    **unacked_keys(CELERY_TASK_DEFAULT_QUEUE),
}
# A restore runs under a Redis lock that expires by itself; a worker killed while holding it (the restore
# takes milliseconds, but it runs every interval) would stop every worker's restores until then, kombu's
# default being 5 minutes. Five restore intervals let the others go on soon after.
CELERY_BROKER_TRANSPORT_OPTIONS["unacked_mutex_expire"] = 5 * CELERY_BROKER_TRANSPORT_OPTIONS["unacked_restore_interval"]
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_ACKS_LATE = False  # Declared per task, only where the task is idempotent.
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# A web request that cannot reach the broker gives up quickly; the sweeps send the work later.
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
CELERY_BROKER_CONNECTION_TIMEOUT = env_float("CELERY_BROKER_CONNECTION_TIMEOUT_S", 2.0, minimum=0.1)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = TIME_ZONE
SWEEP_INTERVAL_S = env_int("SWEEP_INTERVAL_S", 30, minimum=1)
# A transitional state untouched for this long is taken as a lost message.
STUCK_AFTER_S = env_int("STUCK_AFTER_S", 300, minimum=1)
INVENTORY_SYNC_INTERVAL_S = env_int("INVENTORY_SYNC_INTERVAL_S", 60, minimum=1)
# Jobs: the scheduler cycle runs this often (and on every submit, finish and cancel), and the
# reconcile sweep reads running attempts' state from the backend this often.
SCHEDULER_CYCLE_INTERVAL_S = env_float("SCHEDULER_CYCLE_INTERVAL_S", 3.0, minimum=0.1)
JOB_RECONCILE_INTERVAL_S = env_float("JOB_RECONCILE_INTERVAL_S", 2.0, minimum=0.1)
# A worker launching an attempt holds a lease on it this long, renewed while the launch runs; a
# lease that ran out (the worker died) lets the reconcile launch the attempt again.
JOB_LAUNCH_LEASE_S = env_float("JOB_LAUNCH_LEASE_S", 15.0, minimum=1.0)
# An admitted attempt no worker has claimed for this long gets its launch message sent again.
JOB_LAUNCH_RESEND_AFTER_S = env_float("JOB_LAUNCH_RESEND_AFTER_S", 10.0, minimum=1.0)
# The longest the reconcile leaves a job alone after errors on it (the backoff doubles up to this).
JOB_RECONCILE_BACKOFF_MAX_S = env_float("JOB_RECONCILE_BACKOFF_MAX_S", 60.0, minimum=1.0)
# How many jobs one tenant may have waiting (queued) at once; a submit past it answers 429.
JOB_QUEUED_MAX_PER_TENANT = env_int("JOB_QUEUED_MAX_PER_TENANT", 200, minimum=1)
# How long an Idempotency-Key of POST /api/v1/jobs/ answers the job it first made.
IDEMPOTENCY_KEY_TTL_S = env_int("IDEMPOTENCY_KEY_TTL_S", 86400, minimum=60)
# Registries a custom job's image may come from (comma-separated prefixes; Kubernetes backend only).
ALLOWED_IMAGE_REGISTRIES = [r.strip() for r in env_str("ALLOWED_IMAGE_REGISTRIES", "nvcr.io/nvidia").split(",") if r.strip()]
# Inference endpoints: the reconcile reads every replica this often; the autoscaler's target of
# requests in flight per replica; how long the load must stay low before a scale-in; and how long
# without a request before an endpoint with min_replicas 0 scales to zero.
ENDPOINT_RECONCILE_INTERVAL_S = env_float("ENDPOINT_RECONCILE_INTERVAL_S", 2.0, minimum=0.1)
ENDPOINT_TARGET_INFLIGHT = env_float("ENDPOINT_TARGET_INFLIGHT", 8.0, minimum=0.1)
ENDPOINT_SCALE_IN_AFTER_S = env_float("ENDPOINT_SCALE_IN_AFTER_S", 30.0, minimum=0.0)
ENDPOINT_IDLE_AFTER_S = env_float("ENDPOINT_IDLE_AFTER_S", 300.0, minimum=1.0)
# A foreign engine (vLLM, TGI, SGLang) reports its KV-cache use: at this mean over its ready replicas, one more.
ENDPOINT_KV_CACHE_HIGH = env_float("ENDPOINT_KV_CACHE_HIGH", 0.9, minimum=0.01)
# Workspaces (runners/workspaces/, docs/workspaces.md): how often the pass asks each one's JupyterLab whether
# it answers and what it did last; how long a probe may take; minutes without activity before the idle cull
# stops one (a workspace may set its own); what one asks by default.
WORKSPACE_RECONCILE_INTERVAL_S = env_float("WORKSPACE_RECONCILE_INTERVAL_S", 5.0, minimum=0.1)
WORKSPACE_PROBE_TIMEOUT_S = env_float("WORKSPACE_PROBE_TIMEOUT_S", 2.0, minimum=0.1)
WORKSPACE_UNANSWERED_S = env_float("WORKSPACE_UNANSWERED_S", 30.0, minimum=0.1)
WORKSPACE_IDLE_MINUTES = env_float("WORKSPACE_IDLE_MINUTES", 60.0, minimum=0.01)
WORKSPACE_CPU_MILLI = env_int("WORKSPACE_CPU_MILLI", 2000, minimum=250)
WORKSPACE_MEMORY_MIB = env_int("WORKSPACE_MEMORY_MIB", 8192, minimum=1024)
# The edge (runners/edge/, docs/edge.md): the asynchronous front of the endpoints.
EDGE_MAX_BODY_BYTES = env_int("EDGE_MAX_BODY_BYTES", 64 * 1024, minimum=1024)
EDGE_TABLE_REFRESH_S = env_float("EDGE_TABLE_REFRESH_S", 0.5, minimum=0.05)
EDGE_AUTH_CACHE_S = env_float("EDGE_AUTH_CACHE_S", 5.0, minimum=0.0)
EDGE_PROBE_INTERVAL_S = env_float("EDGE_PROBE_INTERVAL_S", 0.5, minimum=0.05)
EDGE_PROBE_TIMEOUT_S = env_float("EDGE_PROBE_TIMEOUT_S", 0.5, minimum=0.05)
EDGE_PROBE_FAILURES = env_int("EDGE_PROBE_FAILURES", 2, minimum=1)
EDGE_DEADLINE_MARGIN_MS = env_float("EDGE_DEADLINE_MARGIN_MS", 50.0, minimum=0.0)
EDGE_IN_FLIGHT_PER_REPLICA = env_int("EDGE_IN_FLIGHT_PER_REPLICA", 0, minimum=0)
EDGE_CONNECT_TIMEOUT_S = env_float("EDGE_CONNECT_TIMEOUT_S", 1.0, minimum=0.05)
# How long the edge keeps a client's idle connection open (uvicorn's own default is 5 s). Longer than the idle
# timeout of a load balancer in front (60 s on the common ones), so it is never the edge that closes a connection
# the balancer is about to reuse, and a client that pauses need not reconnect.
EDGE_KEEPALIVE_S = env_float("EDGE_KEEPALIVE_S", 75.0, minimum=1.0)
# The reconcile asks each replica's /readyz and /metrics with this timeout, this many replicas at once.
ENDPOINT_PROBE_TIMEOUT_S = env_float("ENDPOINT_PROBE_TIMEOUT_S", 1.0, minimum=0.1)
ENDPOINT_PROBE_CONCURRENCY = env_int("ENDPOINT_PROBE_CONCURRENCY", 16, minimum=1)
# Utilization and cost: readings of every open attempt's devices this often; raw samples kept this
# many days (then averaged per 5 minutes), 5-minute ones this many (then per hour), hourly ones this
# many; an allocation under the idle threshold for the whole window is flagged idle; the currency of
# storage and unpriced GPU time, and what one GB kept for 30 days costs.
# Mail (budget alerts): Django's backend by its dotted path; the console one prints mails to the log.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "gpu-portal@localhost")
# Seconds an SMTP connect or command may take, so a hung mail server cannot hold a worker.
EMAIL_TIMEOUT = env_float("EMAIL_TIMEOUT", 10.0, minimum=0.1)
USAGE_SAMPLE_INTERVAL_S = env_float("USAGE_SAMPLE_INTERVAL_S", 30.0, minimum=1.0)
USAGE_SETTLE_INTERVAL_S = env_float("USAGE_SETTLE_INTERVAL_S", 300.0, minimum=1.0)
# A settle sweep stops after this long (at the end of a batch) and the next one goes on: well within the visibility timeout.
USAGE_SETTLE_BUDGET_S = env_float("USAGE_SETTLE_BUDGET_S", 120.0, minimum=1.0)
USAGE_RAW_RETENTION_DAYS = env_int("USAGE_RAW_RETENTION_DAYS", 1, minimum=1)
USAGE_5M_RETENTION_DAYS = env_int("USAGE_5M_RETENTION_DAYS", 30, minimum=1)
USAGE_RETENTION_DAYS = env_int("USAGE_RETENTION_DAYS", 400, minimum=1)
USAGE_IDLE_THRESHOLD_PCT = env_float("USAGE_IDLE_THRESHOLD_PCT", 10.0, minimum=0.0)
USAGE_IDLE_WINDOW_S = env_float("USAGE_IDLE_WINDOW_S", 1800.0, minimum=1.0)
USAGE_CURRENCY = env_str("USAGE_CURRENCY", "USD")
USAGE_STORAGE_PRICE_PER_GB_MONTH = env_decimal("USAGE_STORAGE_PRICE_PER_GB_MONTH", "0.10", minimum="0")
# Notifications: how long one webhook POST may take, how many tries a delivery gets, and the first
# wait before trying again (doubled after each failed try: 10, 20, 40 ... s).
NOTIFY_WEBHOOK_TIMEOUT_S = env_float("NOTIFY_WEBHOOK_TIMEOUT_S", 5.0, minimum=0.1)
NOTIFY_WEBHOOK_MAX_ATTEMPTS = env_int("NOTIFY_WEBHOOK_MAX_ATTEMPTS", 6, minimum=1)
NOTIFY_WEBHOOK_BACKOFF_S = env_float("NOTIFY_WEBHOOK_BACKOFF_S", 10.0, minimum=0.0)
# Webhooks reach public (global) addresses only, checked when added and at every try; on, any address
# (loopback, private, link-local) is allowed: a receiver on the cluster's own network, or tests.
NOTIFY_WEBHOOK_ALLOW_PRIVATE = env_bool("NOTIFY_WEBHOOK_ALLOW_PRIVATE", False)
# How long a worker's claim on an event's mail holds: a worker that died mid-mail lets go after it and
# the sweep mails it again. Longer than mailing an event's members takes (EMAIL_TIMEOUT bounds each step).
NOTIFY_MAIL_CLAIM_S = env_float("NOTIFY_MAIL_CLAIM_S", 120.0, minimum=1.0)
# How many webhooks one tenant may have.
NOTIFY_WEBHOOK_MAX_PER_TENANT = env_int("NOTIFY_WEBHOOK_MAX_PER_TENANT", 10, minimum=1)
# Code bundles (runners.bundles): where their archives lie, an fsspec URL (a folder, or s3://bucket/prefix
# in production) with its fsspec options as JSON (for an S3-compatible server: {"endpoint_url": "..."});
# the most a bundle may hold unpacked, in bytes and in members (files and folders); and the compression
# ratio past which an archive is taken for a zip bomb.
BUNDLE_STORAGE_URL = env_str("BUNDLE_STORAGE_URL", f"file://{VAR_DIR / 'bundles'}")
BUNDLE_STORAGE_OPTIONS = env_json_object("BUNDLE_STORAGE_OPTIONS", '{"endpoint_url": "https://s3.example.com"}')
# The storage layer's blob store (runners.storage.blobs): dataset shards, checkpoint chunks and model
# weights, each stored once by content hash, under an fsspec URL (a folder, or s3://bucket/prefix in
# production) with its fsspec options as JSON.
DATA_STORAGE_URL = env_str("DATA_STORAGE_URL", f"file://{VAR_DIR / 'store'}")
DATA_STORAGE_OPTIONS = env_json_object("DATA_STORAGE_OPTIONS", '{"endpoint_url": "https://s3.example.com"}')
# Node caches on the local backend (runners.storage.nodecache): the folder holding each node's cache
# (<NODE_CACHE_DIR>/<node name>/) and each cache's size in bytes, where the node's pool sets neither.
NODE_CACHE_DIR = Path(env_str("NODE_CACHE_DIR", str(VAR_DIR / "node-cache")))
NODE_CACHE_BYTES = env_int("NODE_CACHE_BYTES", 20 * 1024**3, minimum=0)
# The checkpoint store (runners/jobs/checkpoint_store.py): whether recorded checkpoints are copied into
# DATA_STORAGE_URL as deduplicated chunks, and how often the sweep resends pending ones, applies retention
# and collects chunks no checkpoint names.
CHECKPOINT_STORE_ENABLED = env_bool("CHECKPOINT_STORE_ENABLED", True)
# How long a worker holds a checkpoint it is storing (renewed while it works; the sweep hands one past its
# lease to another), and the storing thread's priority: idle (SCHED_IDLE), nice (19) or normal.
CHECKPOINT_STORE_LEASE_S = env_int("CHECKPOINT_STORE_LEASE_S", 600, minimum=10)
CHECKPOINT_STORE_PRIORITY = env_choice("CHECKPOINT_STORE_PRIORITY", "idle", ("idle", "nice", "normal"))
CHECKPOINT_SWEEP_INTERVAL_S = env_float("CHECKPOINT_SWEEP_INTERVAL_S", 300.0, minimum=1.0)
# Datasets (runners.datasets): the largest shard a version may hold, the most shards in one version, the
# most bytes one upload request carries, the storage URLs a tenant may register a dataset from (`{tenant}`
# is its slug: the portal's own credentials read them, so a tenant names only its own prefix) with their
# fsspec options as JSON, and the shard size a worker packs a registered folder into.
DATASET_SHARD_MAX_BYTES = env_int("DATASET_SHARD_MAX_BYTES", 256 * 1024 * 1024, minimum=1024)
DATASET_MAX_SHARDS = env_int("DATASET_MAX_SHARDS", 100_000, minimum=1)
DATASET_UPLOAD_PART_BYTES = env_int("DATASET_UPLOAD_PART_BYTES", 8 * 1024 * 1024, minimum=64 * 1024)
DATASET_SOURCE_URLS = env_list("DATASET_SOURCE_URLS", [f"file://{VAR_DIR / 'datasets-incoming'}/{{tenant}}/"])
DATASET_SOURCE_OPTIONS = env_json_object("DATASET_SOURCE_OPTIONS", '{"endpoint_url": "https://s3.example.com"}')
# The datasets' sweep: an open upload untouched this long is discarded with its parts; a registration
# untouched this long is sent to a worker again, at most DATASET_REGISTER_MAX_SENDS times in all.
DATASET_UPLOAD_LEASE_S = env_int("DATASET_UPLOAD_LEASE_S", 86400, minimum=60)
DATASET_REGISTER_LEASE_S = env_int("DATASET_REGISTER_LEASE_S", 900, minimum=10)
DATASET_REGISTER_MAX_SENDS = env_int("DATASET_REGISTER_MAX_SENDS", 3, minimum=1)
DATASET_REGISTER_SHARD_BYTES = env_int("DATASET_REGISTER_SHARD_BYTES", 64 * 1000 * 1000, minimum=1024)
# The node cache agents' token on Kubernetes (the Secret portal-cache-agent, key `token`): it authenticates
# their reports and keys the grants that say what each pod may read from its node's cache. Empty: no
# agent is believed, and a job that reads datasets is refused at launch on Kubernetes.
CACHE_AGENT_TOKEN = env_str("CACHE_AGENT_TOKEN", "")
BUNDLE_MAX_BYTES = env_int("BUNDLE_MAX_BYTES", 100 * 1000 * 1000, minimum=1024)
BUNDLE_MAX_FILES = env_int("BUNDLE_MAX_FILES", 10000, minimum=1)
BUNDLE_MAX_RATIO = env_int("BUNDLE_MAX_RATIO", 200, minimum=2)
# Paths whose views read and bound their request bodies themselves, exempt from REQUEST_MAX_BODY_BYTES: a
# bundle upload streams to a temporary file and stops where no archive within the BUNDLE_ limits reaches.
REQUEST_BODY_BOUNDED_BY_VIEW = [
    r"^/api/v1/tenants/[a-z0-9-]+/bundles/$",
    r"^/api/v1/tenants/[a-z0-9-]+/datasets/[a-z0-9-]+/versions/\d+/shards/[0-9a-f]{64}/$",
    r"^/checkpoints/upload/[^/]+/(chunks/[0-9a-f]{64})?$",
]
# The portal's public address (https://portal.example.com): links in notifications are absolute when
# set; empty, they are paths (/jobs/12/).
PORTAL_PUBLIC_URL = env_str("PORTAL_PUBLIC_URL", "")
CELERY_BEAT_SCHEDULE = {
    "environment-sweep": {"task": "runners.tasks.environment_sweep", "schedule": SWEEP_INTERVAL_S},
    "inventory-sync": {"task": "runners.tasks.inventory_sync", "schedule": INVENTORY_SYNC_INTERVAL_S},
    "partition-change-sweep": {"task": "runners.tasks.partition_change_sweep", "schedule": SWEEP_INTERVAL_S},
    # A periodic run not started within its interval is dropped: the next one does the same work,
    # and a busy worker must not find a backlog of cycles in front of the launches.
    "scheduler-cycle": {"task": "runners.tasks.scheduler_cycle", "schedule": float(SCHEDULER_CYCLE_INTERVAL_S),
                        "options": {"expire_seconds": max(1, round(SCHEDULER_CYCLE_INTERVAL_S))}},
    "jobs-reconcile": {"task": "runners.tasks.jobs_reconcile", "schedule": float(JOB_RECONCILE_INTERVAL_S),
                       "options": {"expire_seconds": max(1, round(JOB_RECONCILE_INTERVAL_S))}},
    "endpoints-reconcile": {"task": "runners.tasks.endpoints_reconcile", "schedule": float(ENDPOINT_RECONCILE_INTERVAL_S),
                            "options": {"expire_seconds": max(1, round(ENDPOINT_RECONCILE_INTERVAL_S))}},
    "workspaces-reconcile": {"task": "runners.tasks.workspaces_reconcile",
                             "schedule": float(WORKSPACE_RECONCILE_INTERVAL_S),
                             "options": {"expire_seconds": max(1, round(WORKSPACE_RECONCILE_INTERVAL_S))}},
    "usage-sample": {"task": "runners.tasks.usage_sample", "schedule": float(USAGE_SAMPLE_INTERVAL_S),
                     "options": {"expire_seconds": max(1, round(USAGE_SAMPLE_INTERVAL_S))}},
    "usage-settle": {"task": "runners.tasks.usage_settle", "schedule": float(USAGE_SETTLE_INTERVAL_S)},
    "notifications-sweep": {"task": "runners.tasks.notifications_sweep", "schedule": SWEEP_INTERVAL_S},
    "node-caches-sync": {"task": "runners.nodecache.tasks.caches_sync", "schedule": SWEEP_INTERVAL_S},
    "checkpoints-sweep": {"task": "runners.jobs.tasks.checkpoints_sweep", "schedule": CHECKPOINT_SWEEP_INTERVAL_S},
    "datasets-sweep": {"task": "runners.datasets.tasks.versions_sweep", "schedule": SWEEP_INTERVAL_S},
    # Model weights no kept version names (a delete also sends it at once).
    "model-weights-sweep": {"task": "runners.registry.tasks.model_weights_sweep", "schedule": 3600.0},
}
# Partition changes: how long to wait for nodes to report a new layout, and how
# long preempted work gets to write its checkpoint.
PARTITION_APPLY_TIMEOUT_S = env_int("PARTITION_APPLY_TIMEOUT_S", 900, minimum=1)
PARTITION_POLL_INTERVAL_S = env_float("PARTITION_POLL_INTERVAL_S", 2.0, minimum=0)
# One default for the grace period everywhere: the scheduler's own (runners.scheduler.admission.cycle).
PREEMPTION_GRACE_PERIOD_S = env_int("PREEMPTION_GRACE_PERIOD_S", int(DEFAULT_GRACE_PERIOD_S), minimum=0)
# Defragmentation by migration (runners.scheduling.defrag): the GPU-seconds moves may cost in any hour, as a
# share of the GPU-seconds held in that hour (0 turns moves off); how long a moved job is left where it goes;
# and what a move is expected to cost its GPUs while the cycle has seen no checkpoint and restore of the flavor.
DEFRAG_BUDGET = env_float("DEFRAG_BUDGET", 0.02, minimum=0, maximum=1)
DEFRAG_MOVE_WINDOW_S = env_int("DEFRAG_MOVE_WINDOW_S", 3600, minimum=0)
DEFRAG_MOVE_COST_S = env_float("DEFRAG_MOVE_COST_S", 60.0, minimum=0, maximum=86400)
# A running partition change renews its lease as it works; one not renewed for this long is resumed.
PARTITION_LEASE_S = env_int("PARTITION_LEASE_S", 120, minimum=1)

# Cluster backends.
CLUSTER_BACKEND = env_choice("CLUSTER_BACKEND", "local", ("local", "kubernetes"))
# A dotted path to a callable that returns a ClusterBackend, used instead of CLUSTER_BACKEND
# when set: a backend of your own (or a test's, see tests/support/backends.py).
CLUSTER_BACKEND_FACTORY = env_str("CLUSTER_BACKEND_FACTORY", "")
LOCAL_CLUSTER_FILE = env_str("LOCAL_CLUSTER_FILE", str(BASE_DIR / "runners" / "clusters" / "demo.yaml"))
LOCAL_WORKSPACE_DIR = Path(env_str("LOCAL_WORKSPACE_DIR", str(VAR_DIR / "workspaces")))
# Where the local backend runs jobs: one folder per job (its checkpoints, metrics and logs).
LOCAL_JOBS_DIR = Path(env_str("LOCAL_JOBS_DIR", str(VAR_DIR / "jobs")))
# Simulated provisioning latency of the local backend, so the demo shows an
# environment passing through `provisioning` the way a real cluster does.
LOCAL_PROVISION_DELAY_S = env_float("LOCAL_PROVISION_DELAY_S", 1.0, minimum=0)
# Add the GPUs NVML finds on this machine to the local inventory.
LOCAL_USE_NVML = env_bool("LOCAL_USE_NVML", True)
# The sandbox a tenant's own code (script jobs) runs in on the local backend (docs/sandbox.md): auto (on where
# bubblewrap works here, probed once; off with a warning otherwise), on (a script job fails without it) or off.
LOCAL_SANDBOX = env_choice("LOCAL_SANDBOX", "auto", ("auto", "on", "off"))
KUBECONFIG = env_str("KUBECONFIG", "")
KUBERNETES_IN_CLUSTER = env_bool("KUBERNETES_IN_CLUSTER", False)
KUBERNETES_FIELD_MANAGER = env_str("KUBERNETES_FIELD_MANAGER", "gpu-portal")
# How a portal username becomes a Kubernetes RBAC subject (an OIDC prefix, say).
KUBERNETES_USERNAME_TEMPLATE = env_str("KUBERNETES_USERNAME_TEMPLATE", "{username}")
if "{username}" not in KUBERNETES_USERNAME_TEMPLATE:
    raise ImproperlyConfigured("KUBERNETES_USERNAME_TEMPLATE must contain {username}, e.g. 'oidc:{username}'.")
# Kept under CELERY_VISIBILITY_TIMEOUT_S, so a teardown still waiting is never handed to a second worker.
# The namespace the portal itself runs in: its router reaches inference replicas from there (each
# environment's NetworkPolicies let that namespace, and no other, reach the servers' port). Empty: none.
KUBERNETES_PORTAL_NAMESPACE = env_str("KUBERNETES_PORTAL_NAMESPACE", "gpu-portal")
KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S = env_int("KUBERNETES_NAMESPACE_DELETE_TIMEOUT_S", 120, minimum=1)
KUBERNETES_REQUEST_TIMEOUT_S = env_float("KUBERNETES_REQUEST_TIMEOUT_S", 30.0, minimum=1)
# A member's kubeconfig (GET /api/v1/environments/{id}/kubeconfig/): how long its token lives (the
# TokenRequest API refuses less than ten minutes), and the timeout of each cluster call made while they wait.
KUBECONFIG_TOKEN_TTL_S = env_int("KUBECONFIG_TOKEN_TTL_S", 3600, minimum=600)
KUBECONFIG_REQUEST_TIMEOUT_S = env_float("KUBECONFIG_REQUEST_TIMEOUT_S", 5.0, minimum=1)
# What a member's kubeconfig names as the API server and the CA that signs its certificate (a PEM
# file), for where the portal reaches the cluster another way (in-cluster: https://10.96.0.1). Empty:
# the portal's own. A kubeconfig without TLS verification is never handed out (409 naming KUBECONFIG_CA_FILE).
KUBECONFIG_SERVER_URL = env_str("KUBECONFIG_SERVER_URL", "")
KUBECONFIG_CA_FILE = env_str("KUBECONFIG_CA_FILE", "")
# The namespace, the portal's own, where members' ServiceAccounts for their kubeconfigs live (one per
# member and environment). No tenant may be granted anything in it: whoever can make pods there can
# run as those ServiceAccounts. The portal creates it.
KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE = env_str("KUBERNETES_MEMBER_ACCOUNTS_NAMESPACE", "gpu-portal-members")
# Where the NVIDIA GPU Operator runs, and the ConfigMaps its ClusterPolicy points at
# (migManager.config.name and devicePlugin.config.name).
KUBERNETES_GPU_OPERATOR_NAMESPACE = env_str("KUBERNETES_GPU_OPERATOR_NAMESPACE", "gpu-operator")
KUBERNETES_MIG_PARTED_CONFIG_MAP = env_str("KUBERNETES_MIG_PARTED_CONFIG_MAP", "portal-mig-parted-config")
KUBERNETES_DEVICE_PLUGIN_CONFIG_MAP = env_str("KUBERNETES_DEVICE_PLUGIN_CONFIG_MAP", "portal-device-plugin-config")
# Node labels that carry the pool and the topology the scheduler packs gangs by.
KUBERNETES_POOL_LABEL = env_str("KUBERNETES_POOL_LABEL", "portal.gpu/node-pool")
KUBERNETES_RACK_LABEL = env_str("KUBERNETES_RACK_LABEL", "topology.portal.gpu/rack")
KUBERNETES_BLOCK_LABEL = env_str("KUBERNETES_BLOCK_LABEL", "topology.portal.gpu/block")
KUBERNETES_NVLINK_DOMAIN_LABEL = env_str("KUBERNETES_NVLINK_DOMAIN_LABEL", "topology.portal.gpu/nvlink-domain")
# Training jobs: pods name this scheduler (kube-scheduler leaves them alone) and the portal binds them.
KUBERNETES_SCHEDULER_NAME = env_str("KUBERNETES_SCHEDULER_NAME", "gpu-portal")
# The image the pytorch-ddp template runs: the portal's own (it holds runners/workloads/train.py and torch).
KUBERNETES_TRAINER_IMAGE = env_str("KUBERNETES_TRAINER_IMAGE", "ghcr.io/gpu-portal/portal:latest")
# Each environment's checkpoint volume (ReadWriteMany); an empty class means the cluster's default.
KUBERNETES_CHECKPOINT_STORAGE_CLASS = env_str("KUBERNETES_CHECKPOINT_STORAGE_CLASS", "")
KUBERNETES_CHECKPOINT_VOLUME_SIZE = env_str("KUBERNETES_CHECKPOINT_VOLUME_SIZE", "100Gi")
KUBERNETES_FINISHED_JOB_TTL_S = env_int("KUBERNETES_FINISHED_JOB_TTL_S", 86400, minimum=0)
KUBERNETES_WATCH_TIMEOUT_S = env_int("KUBERNETES_WATCH_TIMEOUT_S", 1, minimum=1)
KUBERNETES_NODE_LOST_TIMEOUT_S = env_float("KUBERNETES_NODE_LOST_TIMEOUT_S", 60.0, minimum=0)
# The Prometheus that scrapes NVIDIA's DCGM exporter, where the Kubernetes backend reads GPU utilization. Empty: none.
PROMETHEUS_URL = env_str("PROMETHEUS_URL", "")
if PROMETHEUS_URL and not PROMETHEUS_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured(f"PROMETHEUS_URL={PROMETHEUS_URL!r} must be http://... or https://... (or empty: none).")

# Logs (portal/logs.py): json, one object a line with timestamp, level, logger, event and the request id;
# or plain, one readable line. The same in the web process, workers and beat.
LOG_FORMAT = env_choice("LOG_FORMAT", "plain" if DEBUG else "json", ("json", "plain"))
LOG_LEVEL = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR"))
LOGGING = logging_config(LOG_FORMAT, LOG_LEVEL)

# Error reports to Sentry (or a server that speaks its protocol) when SENTRY_DSN is set: exceptions of
# the web process and of tasks, never a user's personal data; SENTRY_TRACES_SAMPLE_RATE of requests
# and tasks also send their timings.
SENTRY_DSN = env_str("SENTRY_DSN", "")
SENTRY_ENVIRONMENT = env_str("SENTRY_ENVIRONMENT", "development" if DEBUG else "production")
SENTRY_TRACES_SAMPLE_RATE = env_float("SENTRY_TRACES_SAMPLE_RATE", 0.0, minimum=0.0)
if SENTRY_TRACES_SAMPLE_RATE > 1:
    raise ImproperlyConfigured(f"SENTRY_TRACES_SAMPLE_RATE={SENTRY_TRACES_SAMPLE_RATE} must be between 0 and 1.")
if SENTRY_DSN:
    init_sentry(SENTRY_DSN, environment=SENTRY_ENVIRONMENT, traces_sample_rate=SENTRY_TRACES_SAMPLE_RATE)
