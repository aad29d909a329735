"""The sandbox account is made once, whoever gets there first: two processes that both find it missing and
both run useradd must both end up with it (the loser's useradd finds the name taken)."""

import os
import pwd
import shutil

import pytest

from runners.workloads import sandbox

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                       reason="making the sandbox account takes root and useradd"),
]


def test_an_account_made_by_another_process_meanwhile_is_used_not_refused(monkeypatch):
    made = sandbox.account()  # whoever made it, it exists now
    real = pwd.getpwnam
    looked = []

    def missing_at_first(name):
        # This process's first look-up lost the race: another made the account just after it.
        looked.append(name)
        if len(looked) == 1:
            raise KeyError(name)
        return real(name)

    monkeypatch.setattr(sandbox.pwd, "getpwnam", missing_at_first)
    assert sandbox.account() == made
    assert len(looked) == 2  # useradd ran, found the name taken, and the account was read again
