"""The log as a person reads it: the tagged lines a trainer or the SDK writes for the portal are left out."""

import pytest

from runners.jobs.selectors import without_progress_lines
from runners.workloads.progress import CHECKPOINT_TAG, METRIC_TAG, STOPPED_TAG, tagged_line

pytestmark = pytest.mark.unit


def test_the_sdks_stop_record_is_hidden_like_the_metric_and_checkpoint_lines():
    text = "\n".join([
        "epoch 1 done",
        tagged_line(METRIC_TAG, {"step": 1, "loss": 2.0}),
        tagged_line(CHECKPOINT_TAG, {"step": 1, "path": "checkpoints/step-00000001.pt"}),
        tagged_line(STOPPED_TAG, {"attempt": 1, "rank": 0, "reason": "SIGTERM received"}),
        f"{STOPPED_TAG}: the script's own words, not a record",
        "stopping at step 1",
    ])
    assert without_progress_lines(text) == [
        "epoch 1 done", f"{STOPPED_TAG}: the script's own words, not a record", "stopping at step 1"]
