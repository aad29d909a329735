"""Through the edge with the `openai` client: base_url the endpoint, an API token the key, a real replica
(the shipped server's OpenAI routes) behind. (A stream the client drops: tests/edge/test_edge_proxy.py.)"""

import time

import openai
import pytest

from tests.edge.conftest import SETTLE_S, token_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_the_openai_client_streams_a_completion_through_the_edge(serving, edge, owner, outsider):
    serving(1)
    time.sleep(SETTLE_S)
    client = openai.OpenAI(base_url=f"{edge.url}/serve/acme/chat/v1", api_key=token_for(owner), max_retries=0)

    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="chat", prompt="hello ", max_tokens=12, stream=True) if chunk.choices]
    assert len(pieces) >= 2 and "".join(pieces)
    answer = client.completions.create(model="chat", prompt="hello ", max_tokens=6)
    assert answer.usage.completion_tokens == 6 and answer.choices[0].text
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens == 5
    streamed = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True) if chunk.choices]
    assert "".join(streamed)

    # Another tenant's token: 404, as for every tenant-owned object.
    stranger = openai.OpenAI(base_url=f"{edge.url}/serve/acme/chat/v1", api_key=token_for(outsider), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.completions.create(model="chat", prompt="hello", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{edge.url}/serve/acme/chat/v1", api_key="nobody", max_retries=0).completions.create(
            model="chat", prompt="hello", max_tokens=4)
