"""The README's promises that code can check."""

import re
from pathlib import Path

from runners.jobs import services as jobs

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_job_spec_table_names_every_field_the_check_takes_and_no_other():
    table = README.split("**The job spec**", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert named == set(jobs.FIELDS)


def test_the_curl_lines_use_the_portal_variable_and_define_every_token_they_send():
    api = README.split("## The API", 1)[1].split("| endpoint |", 1)[0]
    assert "127.0.0.1:8000/api" not in api
    for name in set(re.findall(r"\$([A-Z_]+)", api)):
        assert re.search(rf"^{name}=", api, re.M), f"${name} is used but never set"
