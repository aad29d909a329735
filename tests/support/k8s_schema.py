"""kubernetes-validate's schema files, read once a process.

`kubernetes_validate.validate` opens and parses the schema files it needs on every call, the strict
`_definitions.json` (1.2 MB of JSON) among them: about 15 ms of CPU a call on this machine. The stand-in
validates every object it is sent and every answer it gives, and the manifest tests validate everything the
backends build, so the suite parsed that file tens of thousands of times. The files are read-only data; with
their parsed contents kept per process, a call costs well under a millisecond, and the validation itself is
still kubernetes-validate's own, strict as before.
"""

import functools


def read_each_schema_once() -> None:
    """Keep what `kubernetes_validate.utils.schema_contents` parses, per file and version (idempotent)."""
    from kubernetes_validate import utils

    if not hasattr(utils.schema_contents, "cache_info"):
        utils.schema_contents = functools.cache(utils.schema_contents)
