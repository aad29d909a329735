"""What a webhook may reach, decided on the address itself: IPv4 embedded in IPv6 (IPv4-compatible, NAT64,
6to4, mapped) is unwrapped and checked as IPv4, and multicast is refused; checked when the webhook is added
and again on the address each try connects to."""

import pytest

from common.errors import Invalid
from runners.notifications import services

pytestmark = pytest.mark.unit

NON_PUBLIC = [
    "::127.0.0.1",  # IPv4-compatible loopback
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b:1::a00:1",  # local-use NAT64 (RFC 8215)
    "2002:7f00:1::",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "::ffff:10.0.0.1",  # IPv4-mapped private
    "ff0e::1",  # global-scope IPv6 multicast
]


@pytest.mark.parametrize("address", ["224.0.0.1", "239.1.2.3", *(f"[{a}]" for a in NON_PUBLIC)])
def test_an_address_embedding_a_non_public_one_or_multicast_is_refused_naming_the_url(settings, address):
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(Invalid) as refused:
        services.webhook_url_check(f"http://{address}:8080/h")
    assert refused.value.field == "url" and "public" in str(refused.value)


@pytest.mark.parametrize("address", ["224.0.0.1", *(f"[{a}]" for a in NON_PUBLIC)])
def test_a_try_to_such_an_address_is_refused_before_connecting(settings, address):
    """The send path checks the address it would connect to (a webhook added while the setting allowed it)."""
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = False
    status, error = services._post(f"http://{address}:9/h", b"{}", {})
    assert status is None and error.startswith("Refused: ") and "non-public" in error


@pytest.mark.parametrize("url", [
    "https://1.1.1.1/h", "http://8.8.8.8:8080/h", "https://[2606:4700:4700::1111]/h",
    "https://[::ffff:8.8.8.8]/h", "https://[64:ff9b::808:808]/h", "https://[2002:808:808::1]/h",
])
def test_public_addresses_are_still_allowed(settings, url):
    settings.NOTIFY_WEBHOOK_ALLOW_PRIVATE = False
    assert services.webhook_url_check(url) == url
