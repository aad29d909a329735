"""Logging for every process of the portal: web (gunicorn), worker and beat, through structlog.

One configuration, ``LOGGING`` in settings (``logging_config``), renders every line, the portal's
own ``logging.getLogger(__name__)`` calls, Django's, Celery's and gunicorn's alike:

- ``LOG_FORMAT=json``: one JSON object a line, for a log pipeline;
- ``LOG_FORMAT=plain``: one readable line (the default when DEBUG is on).

Every line has ``timestamp`` (UTC, ISO 8601), ``level``, ``logger`` and ``event``, and whatever is
bound in structlog's context variables: the ``request_id`` of the request being served
(``portal.middleware.RequestIdMiddleware``) and, in a worker, the ``request_id`` of the request that
enqueued the task, with the task's ``task`` name and ``task_id`` (the Celery signals below).
"""

import logging
import re
import time
import uuid

import structlog
from celery.signals import before_task_publish, setup_logging, task_postrun, task_prerun
from django.core.signals import request_finished
from django.dispatch import receiver
from django.utils.functional import SimpleLazyObject, empty

REQUEST_ID_HEADER = "X-Request-ID"
# An incoming X-Request-ID is kept when it looks like an id (a proxy's or a client's): letters, digits
# and - _ . : only, at most 128 characters. Anything else is replaced by one of our own.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The Celery message header that carries the request id into the task.
TASK_HEADER = "request_id"

access_logger = structlog.get_logger("portal.access")


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: str | None) -> str | None:
    return value if value is not None and REQUEST_ID_RE.fullmatch(value) else None


def _shared_processors() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
    ]


def formatter(renderer: str = "plain") -> logging.Formatter:
    """The logging formatter of every handler (``"()"`` in LOGGING); configures structlog as well, so
    that whichever process sets logging up (Django, Celery, gunicorn) gets both."""
    configure_structlog()
    if renderer == "json":
        processors = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # Tracebacks as Python prints them: structlog's default draws each with rich and every frame's
            # locals, about a CPU-second a traceback, which a worker losing its broker logs by the dozen.
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ]
    return structlog.stdlib.ProcessorFormatter(foreign_pre_chain=_shared_processors(), processors=processors)


def configure_structlog() -> None:
    """``structlog.get_logger()`` loggers hand their lines to stdlib logging, rendered as above."""
    structlog.configure(
        processors=[
            *_shared_processors(),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def logging_config(log_format: str, level: str) -> dict:
    """A ``logging.config.dictConfig`` dictionary: one stderr handler, every logger through it."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"structured": {"()": "portal.logs.formatter", "renderer": log_format}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            # gunicorn's own lines (start, workers booting, timeouts) go through the root handler. Its access
            # log stays off: RequestIdMiddleware writes the one access line, with the user and request id.
            "gunicorn.error": {"handlers": [], "propagate": True, "level": level},
            "gunicorn.access": {"handlers": [], "propagate": False, "level": "WARNING"},
        },
    }


def log_request(request, response, started: float) -> None:
    """The access line of one request: method, path, status, duration and who asked."""
    user = request.__dict__.get("user")
    if isinstance(user, SimpleLazyObject):
        # Only a user something already looked up: the access line never costs a session query.
        user = None if user._wrapped is empty else user._wrapped
    access_logger.info(
        "request",
        method=request.method,
        path=request.path,
        status=response.status_code,
        duration_ms=round((time.monotonic() - started) * 1000, 1),
        user_id=user.pk if user is not None and getattr(user, "is_authenticated", False) else None,
    )


@receiver(request_finished)
def _forget_request(**kwargs) -> None:
    """The response is sent and closed: what was bound for the request goes (RequestIdMiddleware binds it)."""
    structlog.contextvars.clear_contextvars()


# --- Error reports ------------------------------------------------------------------------------


def init_sentry(dsn: str, *, environment: str, traces_sample_rate: float) -> None:
    """Report exceptions of requests and tasks to Sentry (settings call this when SENTRY_DSN is set).

    No personal data: no user's address, name or cookies, no request bodies, no frames' local variables. Each event is tagged with
    the request id of the log lines, so a report and its logs are found from one another.
    """
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.integrations.django import DjangoIntegration

    sentry_sdk.init(
        dsn=dsn,
        integrations=[DjangoIntegration(), CeleryIntegration()],
        send_default_pii=False,
        # Nor what a request or a frame held: a job's spec carries its env values (keys, say), and
        # the default scrubber only knows names like "password".
        max_request_body_size="never",
        include_local_variables=False,
        environment=environment,
        traces_sample_rate=traces_sample_rate,
        before_send=_tag_request_id,
    )


def _tag_request_id(event: dict, hint: dict) -> dict:
    context = structlog.contextvars.get_contextvars()
    tags = event.setdefault("tags", {})
    for key in ("request_id", "task", "task_id"):
        if context.get(key):
            tags.setdefault(key, context[key])
    return event


# --- Celery: the request id travels with the message ---------------------------------------------


@setup_logging.connect
def _celery_logging(loglevel=None, **kwargs) -> None:
    """Workers and beat log through LOGGING, like the web process, instead of Celery's own set-up.

    Connecting here is what tells Celery not to configure logging itself; Django's set-up (which the
    worker runs when it loads the app) has already applied LOGGING, so there is nothing left to do.
    """
    from logging.config import dictConfig

    from django.conf import settings

    dictConfig(settings.LOGGING)


@before_task_publish.connect
def _add_request_id_header(headers=None, **kwargs) -> None:
    """A task sent while serving a request (or running a task that has one) carries its request id."""
    request_id = structlog.contextvars.get_contextvars().get("request_id")
    if request_id and headers is not None:
        headers.setdefault(TASK_HEADER, request_id)


@task_prerun.connect
def _bind_task(task_id=None, task=None, **kwargs) -> None:
    request = getattr(task, "request", None)
    if request is None or request.is_eager:
        # Run in the sender's own thread (CELERY_TASK_ALWAYS_EAGER): its request's context stays as it is.
        return
    structlog.contextvars.clear_contextvars()
    request_id = valid_request_id(getattr(request, TASK_HEADER, None))
    values = {"task": task.name, "task_id": task_id}
    if request_id:
        values["request_id"] = request_id
    structlog.contextvars.bind_contextvars(**values)


@task_postrun.connect
def _unbind_task(task=None, **kwargs) -> None:
    request = getattr(task, "request", None)
    if request is not None and not request.is_eager:
        structlog.contextvars.clear_contextvars()
