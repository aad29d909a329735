"""Shared test setup: real PostgreSQL and Redis, personas, and a real Celery worker."""

import socket
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest
from django.conf import settings
from django.test.utils import override_settings
from rest_framework.test import APIClient

from tests.support.k8s_schema import read_each_schema_once
from tests.support.portal_up import kill_job_processes
from tests.support.worker import WorkerProcess, purge_queue

# Each test kept to its file's tier (tests/support/tiers.py); files handed out longest first (tests/durations.json).
pytest_plugins = ["tests.support.tiers", "tests.support.durations", "tests.support.cpu_report"]

# jsonschema (kubernetes-validate's and schemathesis' validator) loads rfc3987-syntax where it is installed, for its
# "iri" format alone, and that compiles some thirty Earley grammars at import: 1.5-4 s of CPU in each pytest process.
# No schema the suite validates against (Kubernetes' OpenAPI, the portal's own) has an "iri" field, so the tests'
# processes go without that one checker; every other format check stays.
sys.modules.setdefault("rfc3987_syntax", None)

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "correct-horse-battery"


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=2):
            return True
    except OSError:
        return False


def pytest_configure(config):
    """Stop at once, saying what to start, when PostgreSQL or Redis is not there (settings already
    refused any other kind of database or broker; `make test` falls back to the embedded ones)."""
    if not _reachable(settings.DATABASE_URL, 5432):
        pytest.exit(
            f"PostgreSQL at {settings.DATABASE_URL} is not answering. Start it with: "
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start; or unset DATABASE_URL "
            "and run `make test`, which then uses this checkout's embedded PostgreSQL.",
            2,
        )
    if not _reachable(settings.CELERY_BROKER_URL, 6379):
        pytest.exit(
            f"Redis at {settings.CELERY_BROKER_URL} is not answering. Start it with: redis-server --daemonize yes "
            '--bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no; or unset CELERY_BROKER_URL and run '
            "`make test`, which then uses this checkout's embedded Redis.",
            2,
        )


@pytest.fixture(scope="session", autouse=True)
def _kubernetes_schemas_read_once():
    """kubernetes-validate parses each schema file once per test process (tests/support/k8s_schema.py)."""
    read_each_schema_once()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(request, django_db_modify_db_settings):
    """After pytest-django names this process's test database: make it a copy of the migrated template
    (tests/support/template_db.py), which pytest-django then keeps (django_db_keepdb below)."""
    from django.db import connections

    from tests.support.template_db import copy_test_database, drop_test_database
    from tests.support.tiers import not_the_tests_doing

    with not_the_tests_doing():
        name = copy_test_database()
    yield
    if not request.config.getvalue("reuse_db"):
        connections.close_all()
        drop_test_database(name)


@pytest.fixture(scope="session")
def django_db_keepdb():
    """pytest-django keeps the copy it finds (a no-op migrate checks it); the fixture above drops it at the end."""
    return True


@pytest.fixture(autouse=True)
def _isolated_workspaces(settings, tmp_path):
    """Each test gets its own local-backend workspace folder."""
    from runners.clusters.registry import get_backend

    settings.LOCAL_WORKSPACE_DIR = tmp_path / "workspaces"
    settings.LOCAL_JOBS_DIR = tmp_path / "jobs"
    # The storage layer's blob store and the nodes' caches, the test's own (never the checkout's var/).
    settings.DATA_STORAGE_URL = f"file://{tmp_path / 'store'}"
    settings.NODE_CACHE_DIR = tmp_path / "node-cache"
    settings.LOCAL_PROVISION_DELAY_S = 0
    settings.LOCAL_USE_NVML = False
    settings.PARTITION_POLL_INTERVAL_S = 0.01
    get_backend.cache_clear()
    yield
    get_backend.cache_clear()
    kill_job_processes(tmp_path / "jobs")


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    """Users made in tests get MD5 hashes (the real hashers still check any other): PBKDF2's
    second or so per user was a large share of the suite; no test is about the hash's strength."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher", *settings.PASSWORD_HASHERS]


# --- Personas ---------------------------------------------------------------


@pytest.fixture
def make_user(db, django_user_model):
    def make(username: str, **extra):
        return django_user_model.objects.create_user(username=username, password=PASSWORD, **extra)

    return make


@pytest.fixture
def tenant(db):
    from tenants.models import Tenant

    return Tenant.objects.create(slug="acme", name="Acme ML")


@pytest.fixture
def other_tenant(db):
    from tenants.models import Tenant

    return Tenant.objects.create(slug="globex", name="Globex Vision")


def _member(make_user, tenant, username, role):
    from tenants.models import Membership

    user = make_user(username)
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def owner(make_user, tenant):
    """Owns the tenant under test."""
    return _member(make_user, tenant, "olivia", "owner")


@pytest.fixture
def teammate(make_user, tenant):
    """A plain member of the same tenant."""
    return _member(make_user, tenant, "tom", "member")


@pytest.fixture
def viewer(make_user, tenant):
    return _member(make_user, tenant, "vera", "viewer")


@pytest.fixture
def outsider(make_user, other_tenant):
    """Owns a different tenant; must never see the first one's objects."""
    return _member(make_user, other_tenant, "oscar", "owner")


@pytest.fixture
def staff(make_user):
    return make_user("sam", is_staff=True)


@pytest.fixture
def inventory(db):
    """The demo cluster file, synced into Node and Gpu rows."""
    from runners.clusters.services import inventory_sync

    return inventory_sync()


@pytest.fixture
def kubernetes_cluster(settings, tmp_path):
    """CLUSTER_BACKEND=kubernetes against the API server stand-in, through a real kubeconfig."""

    from runners.clusters.registry import get_backend
    from tests.support.k8s import deploy_rbac, portal_kubeconfig
    from tests.support.k8s_standin import KubernetesStandIn

    # The portal's token may do what deploy/'s RBAC grants it, no more.
    with KubernetesStandIn(termination_delay_s=0.1, operator_delay_s=0.05, admin_tokens={"standin-token"},
                           portal_rbac=deploy_rbac(), watch_hold_s=0.1) as api:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(portal_kubeconfig(api))
        settings.CLUSTER_BACKEND = "kubernetes"
        settings.KUBECONFIG = str(kubeconfig)
        get_backend.cache_clear()
        yield api
        get_backend.cache_clear()


@pytest.fixture
def flavors(db):
    """The demo cluster synced, a flavor for each kind of its capacity, capacities written: by name."""
    from tests.support.jobs import demo_cluster_with_flavors

    return demo_cluster_with_flavors()


@pytest.fixture
def acme_env(flavors, tenant, owner):
    """A ready environment of acme (no quota: each test gives the one it needs)."""
    from tests.support.jobs import ready_environment

    return ready_environment(actor=owner, tenant=tenant)


@pytest.fixture
def globex_env(flavors, other_tenant, outsider):
    from tests.support.jobs import ready_environment

    return ready_environment(actor=outsider, tenant=other_tenant, name="vision")


@pytest.fixture
def faulty(settings):
    """The Faulty backend of tests/support/backends.py; the test fills the dict it yields (call name: error)."""
    from tests.support.backends import Faulty, use_backend

    use_backend(settings, "faulty")
    Faulty.failing.clear()
    yield Faulty.failing
    Faulty.failing.clear()


@pytest.fixture
def flavor_factory(db):
    def make(name="h100-80gb", kind="whole", gpu_model="H100-80GB", mig_profile=""):
        from quotas.models import ResourceFlavor

        return ResourceFlavor.objects.create(name=name, kind=kind, gpu_model=gpu_model, mig_profile=mig_profile)

    return make


@pytest.fixture
def client_for():
    """An API client authenticated with a real token for the given user."""

    def make(user) -> APIClient:
        from tenants.services import token_create

        client = APIClient()
        _, token = token_create(user=user, name="test client")
        client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        return client

    return make


# --- A real Celery worker (the harness is tests/support/worker.py) ---------------


@pytest.fixture(scope="session", autouse=True)
def _fresh_queue():
    """A queue name of this run's own, removed from Redis at the end."""
    queue = f"portal-test-{uuid.uuid4().hex[:10]}"
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    from portal.celery import app

    app.conf.task_default_queue = queue
    # The cache (login counters) is Redis too: this run's keys apart from any other run's.
    caches = {"default": {**settings.CACHES["default"], "KEY_PREFIX": queue}}
    with override_settings(CACHES=caches):
        yield queue
    try:
        import redis

        client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
        client.delete(queue, *client.keys(f"{queue}*"))
    except Exception as exc:  # Cleanup only; never fail the run for it.
        print(f"Could not remove test queue {queue}: {exc}")


@pytest.fixture
def own_queue(settings):
    """A queue of the test's own, for tests that count what was sent: it waits there to be read, whatever
    consumer another test of this pytest process may have left on the run's queue. Celery reads the default
    queue's name at each send, so everything sent during the test goes there."""
    import redis

    from portal.celery import app

    queue = f"{settings.CELERY_TASK_DEFAULT_QUEUE}-{uuid.uuid4().hex[:8]}"
    before = app.conf.task_default_queue
    settings.CELERY_TASK_DEFAULT_QUEUE = app.conf.task_default_queue = queue
    yield queue
    app.conf.task_default_queue = before
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(queue)


@pytest.fixture
def celery_worker_factory(transactional_db, tmp_path):
    """Start real worker processes, on an empty queue; every one is stopped when the test ends."""
    purge_queue()
    workers: list[WorkerProcess] = []

    def start(*, beat: bool = False, **env_overrides) -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"worker-{len(workers)}.log", beat=beat, **env_overrides)
        workers.append(worker)
        return worker.start()

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture
def celery_worker(celery_worker_factory):
    return celery_worker_factory()
