"""The official Kubernetes client, as the backend's modules import it: without a validator it would load for nothing.

`import kubernetes` imports `kubernetes.dynamic`, whose client imports `kubernetes_validate` wherever that is
installed (the test extra installs it, so every development checkout and CI has it) for
`DynamicClient.validate()`, which the portal never calls. That import loads jsonschema, and jsonschema its format
checkers, one of which (rfc3987-syntax, which JupyterLab's dependencies bring) compiles some thirty Earley grammars
at import: 1.5 s of CPU on these machines, in every worker and web process that uses the Kubernetes backend, for
nothing. Importing the client here, with `kubernetes_validate` hidden for that one import, keeps it out; a process
that imports `kubernetes_validate` itself (the tests' manifest checks do) still gets it whole.
"""

import sys


def _import_without_validator() -> None:
    hidden = "kubernetes" not in sys.modules and "kubernetes_validate" not in sys.modules
    if hidden:
        sys.modules["kubernetes_validate"] = None  # an import of it raises ImportError: the client goes without
    try:
        import kubernetes.dynamic.exceptions  # noqa: F401
        import kubernetes.utils  # noqa: F401
    finally:
        if hidden and "kubernetes_validate" in sys.modules and sys.modules["kubernetes_validate"] is None:
            del sys.modules["kubernetes_validate"]


_import_without_validator()

from kubernetes import client, config, dynamic  # noqa: E402
from kubernetes.dynamic.exceptions import ResourceNotFoundError  # noqa: E402
from kubernetes.utils import parse_quantity  # noqa: E402

__all__ = ["ResourceNotFoundError", "client", "config", "dynamic", "parse_quantity"]
