# syntax=docker/dockerfile:1
#
# The portal's image: web (gunicorn), Celery worker and beat, the migrate Job, and the
# trainer and inference server that Kubernetes jobs run (KUBERNETES_TRAINER_IMAGE).
# Which process runs is chosen by the manifests in deploy/ (command and args); with
# none given, the web server starts.
#
#   docker build -t registry.example.com/gpu-portal:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t gpu-portal:cpu .
#
# torch: the image is also what training and inference pods run on GPU nodes, so by
# default torch comes from PyPI, whose Linux x86_64 wheels are the CUDA build. A
# control plane that never runs the trainer on GPUs (or CI) can take the much smaller
# CPU-only wheel from PyTorch's CPU index with the build argument above.
#
# The base is pinned to an exact patch release; to pin it harder, append the digest
# (`docker buildx imagetools inspect python:3.11.14-slim-bookworm`) as @sha256:...
# to both FROM lines.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- Builder: a virtual environment with every pinned dependency ---------------------
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Empty: torch from PyPI (CUDA). A URL: torch from that index only (e.g. the CPU one).
ARG TORCH_INDEX_URL=""

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Dependencies first, from pyproject.toml alone, so a code change does not reinstall them.
# With TORCH_INDEX_URL set, torch (the version the workloads extra pins) comes from there first.
# A placeholder package tree is enough for pip to install the project with its extra; the
# project itself is then uninstalled again, leaving only the dependencies: the code runs from
# /app (below), since the wheel would leave out the templates and static files, which the
# project does not declare as package data.
COPY pyproject.toml ./
RUN set -eux; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
      torch_pin="$(python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["workloads"])')"; \
      pip install --index-url "$TORCH_INDEX_URL" "$torch_pin"; \
    fi; \
    for pkg in common portal tenants quotas runners audit frontend; do mkdir -p "$pkg" && touch "$pkg/__init__.py"; done; \
    pip install ".[workloads]"; \
    pip uninstall -y gpu-portal; \
    rm -rf /src/*

# --- Final: the venv and the source, nothing that compiles ---------------------------
FROM ${PYTHON_IMAGE} AS final

LABEL org.opencontainers.image.title="gpu-portal" \
      org.opencontainers.image.description="Multi-tenant control plane for shared GPU clusters"

# The unprivileged user every process runs as (UID and GID 10001). USER below names it by
# number, so Kubernetes can check runAsNonRoot without reading /etc/passwd. Training pods run
# the same image as UID 1000 (their own securityContext); everything here is world-readable.
RUN groupadd --system --gid 10001 portal \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin portal

# PORTAL_VAR_DIR and /tmp are the only writable places at run time, both volumes in Kubernetes
# (emptyDir), where the root filesystem is mounted read-only; settings.py creates PORTAL_VAR_DIR
# when it is imported.
# /app/sdk: the gpuportal package (stdlib and fsspec only), which the trainer runs on and a script job's
# init container fetches its bundle with.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app:/app/sdk \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DJANGO_SETTINGS_MODULE=portal.settings \
    PORTAL_VAR_DIR=/var/lib/gpu-portal \
    HOME=/tmp \
    TMPDIR=/tmp \
    GUNICORN_BIND=0.0.0.0:8000

COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY . /app

# Static files are collected now, into the image (whitenoise serves them). Settings refuse
# to load with DEBUG off and no SECRET_KEY, so a throwaway key is given for this one command;
# it never reaches the image's environment, and neither do the server URLs, which nothing connects
# to. The var folder goes to a scratch directory that is removed again. Bytecode is compiled now, since nothing can write it later.
RUN set -eux; \
    DEBUG=false \
    SECRET_KEY=build-only-placeholder-never-used-at-run-time-0123456789abcdef \
    PORTAL_VAR_DIR=/tmp/build-var \
    DATABASE_URL=postgres://collectstatic-needs-no-database@127.0.0.1/portal \
    CELERY_BROKER_URL=redis://127.0.0.1:6379/0 \
    python manage.py collectstatic --noinput --verbosity 0; \
    rm -rf /tmp/build-var; \
    python -m compileall -q /app > /dev/null; \
    install -d -o 10001 -g 10001 -m 0750 /var/lib/gpu-portal

USER 10001:10001
EXPOSE 8000

# The web process (portal/gunicorn_conf.py reads GUNICORN_BIND and the other GUNICORN_* variables).
# The manifests run the worker, beat and migrate with their own command.
CMD ["gunicorn", "--config", "python:portal.gunicorn_conf", "portal.wsgi"]
