"""The suite's kubernetes-validate parses each schema file once a process (tests/support/k8s_schema.py), and
validates as strictly as before."""

import kubernetes_validate
import pytest
from kubernetes_validate import utils

from tests.support.k8s_schema import read_each_schema_once

pytestmark = pytest.mark.unit

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}


def test_each_schema_file_is_parsed_once_and_validation_stays_strict():
    read_each_schema_once()
    read_each_schema_once()
    assert not hasattr(utils.schema_contents.__wrapped__, "cache_info"), "wrapped twice"

    kubernetes_validate.validate(POD, "1.30", strict=True)
    before = utils.schema_contents.cache_info()
    kubernetes_validate.validate(POD, "1.30", strict=True)
    after = utils.schema_contents.cache_info()
    # The pod's schema and the definitions: both from the cache, nothing parsed again.
    assert (after.hits, after.misses) == (before.hits + 2, before.misses)

    typo = {**POD, "spec": {**POD["spec"], "nodeNme": "n1"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="'nodeNme' was unexpected"):
        kubernetes_validate.validate(typo, "1.30", strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**POD, "spec": {"containers": [{"name": "c", "image": 3}]}}, "1.30", strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**POD, "kind": "NoSuchKind"}, "1.30", strict=True)
