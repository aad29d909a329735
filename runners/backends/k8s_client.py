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

# Hidden only where neither is imported yet: `import kubernetes_validate` then raises ImportError, and the client
# goes without; once the client is in, the name is freed for any later import of the validator itself.
_hide = "kubernetes" not in sys.modules and "kubernetes_validate" not in sys.modules
if _hide:
    sys.modules["kubernetes_validate"] = None
try:
    from kubernetes import client, config, dynamic
    from kubernetes.dynamic.exceptions import ResourceNotFoundError
    from kubernetes.utils import parse_quantity
finally:
    if _hide:
        del sys.modules["kubernetes_validate"]

__all__ = ["ResourceNotFoundError", "client", "config", "dynamic", "parse_quantity"]
