"""An inventory may hold GPU models the catalog does not know (the openb trace's P100, G2, ...)."""

import pytest

from quotas.models import ResourceFlavor
from runners.clusters.models import Gpu
from runners.clusters.services import flavors_discover, inventory_sync

pytestmark = pytest.mark.integration


@pytest.mark.django_db
def test_discovery_skips_an_unknown_model_and_still_names_the_rest(settings, tmp_path, caplog):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nold-1,64000,262144,2,P100\nnew-1,96000,786432,8,H100-80GB\n")
    settings.LOCAL_CLUSTER_FILE = str(nodes)
    from runners.clusters.registry import get_backend

    get_backend.cache_clear()
    inventory_sync()
    assert Gpu.objects.filter(model="P100").count() == 2
    created = flavors_discover()
    assert [(f.gpu_model, f.kind) for f in created] == [("H100-80GB", "whole")]
    assert not ResourceFlavor.objects.filter(gpu_model="P100").exists()
    assert "the GPU catalog does not know the model" in caplog.text
