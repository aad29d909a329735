"""The edge's cache of callers: one database lookup per credential at a time, however many requests wait.

Under load a credential's cached caller expires while hundreds of its requests arrive each second; before
the single flight each of them sent its own lookup to the database, one after another on the table's one
thread (a tenth of the edge's CPU at twice an endpoint's capacity, by py-spy)."""

import asyncio
import time

import pytest

from runners.edge.table import Table
from tests.edge.conftest import token_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_requests_arriving_while_a_credential_is_looked_up_share_that_one_lookup(owner):
    token = token_for(owner)

    async def run():
        table = Table(refresh_s=1.0, auth_cache_s=0.3)
        first = await asyncio.gather(*(table.caller(token=token, session_key=None) for _ in range(30)))
        time.sleep(0.4)  # the cached caller expires
        again = await asyncio.gather(*(table.caller(token=token, session_key=None) for _ in range(30)))
        wrong = await asyncio.gather(*(table.caller(token=token + "x", session_key=None) for _ in range(5)))
        return first, again, wrong

    first, again, wrong = asyncio.run(run())
    assert first[0] is not None and first[0].username == owner.username
    # Each lookup builds its own Caller: one object for all thirty means one lookup for all thirty.
    assert all(caller is first[0] for caller in first)
    assert all(caller is again[0] for caller in again)
    assert again[0] is not first[0], "once expired, the credential is looked up again"
    assert wrong == [None] * 5
