"""Remote reward/environment URLs cannot reach loopback, private or link-local addresses unless allow-listed."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from service.egress import EgressPolicy, EgressRefused, check_url, post_json
from tests.loopback_http import QuietHandler, serving


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:6379/", "https://127.0.0.1:5432/", "https://localhost/x", "https://10.1.2.3/",
    "https://192.168.0.10/", "https://172.16.5.5/", "https://169.254.169.254/latest/meta-data/",
    "https://[::1]/", "https://[fd00::1]/", "https://[::ffff:127.0.0.1]/", "https://0.0.0.0/",
    "https://100.64.0.1/",
    # IPv6 forms wrapping a loopback/private IPv4 (NAT64, local-use NAT64, 6to4, IPv4-compatible,
    # IPv4-translated)
    "https://[64:ff9b::7f00:1]/", "https://[64:ff9b::a9fe:a9fe]/", "https://[64:ff9b:1::7f00:1]/",
    "https://[2002:7f00:1::]/", "https://[2002:c0a8:1::1]/", "https://[::127.0.0.1]/", "https://[::10.0.0.1]/",
    "https://[::ffff:0:7f00:1]/", "https://[::ffff:0:a9fe:a9fe]/", "https://[::ffff:0:10.0.0.1]/",
])
def test_non_public_addresses_are_refused(url):
    with pytest.raises(EgressRefused, match="non-public"):
        check_url(url, EgressPolicy())


# Addresses Python's ipaddress calls neither private nor loopback yet not global (the 100.64.0.0/10 shared address
# space), or global yet multicast, each also wrapped in IPv6 (mapped, NAT64, 6to4): an `_is_public` rebuilt from
# is_private / is_loopback / is_reserved, or without its multicast rule, or that vets a wrapped IPv4 by another
# rule than the bare one, lets several of these through, not just one.
@pytest.mark.parametrize("url", [
    "https://100.64.0.1/", "https://100.100.100.100/", "https://100.127.255.254/",
    "https://[::ffff:100.64.0.1]/", "https://[64:ff9b::6440:1]/", "https://[2002:6440:1::1]/",
    "https://224.0.0.251/", "https://239.255.255.250/", "https://[ff02::1]/", "https://[ff0e::1]/",
    "https://[::ffff:224.0.0.251]/", "https://[64:ff9b::e000:fb]/", "https://[2002:e000:fb::1]/",
])
def test_shared_space_and_multicast_addresses_are_refused_bare_and_wrapped(url):
    with pytest.raises(EgressRefused, match="non-public"):
        check_url(url, EgressPolicy())


@pytest.mark.parametrize("url", [
    "https://8.8.8.8/", "https://1.1.1.1/", "https://223.255.255.254/", "https://192.0.0.9/",
    "https://100.63.255.255/", "https://100.128.0.1/",  # just outside 100.64.0.0/10
    "https://[2606:4700:4700::1111]/", "https://[2001:4860:4860::8888]/", "https://[64:ff9b::808:808]/",
])
def test_public_addresses_next_to_refused_ranges_stay_public(url):
    assert check_url(url, EgressPolicy()).host


@pytest.mark.parametrize("url,reason", [
    ("ftp://8.8.8.8/x", "only http"), ("http://8.8.8.8/x", "https is required"),
    ("https://user:pw@8.8.8.8/", "credentials"), ("https:///nohost", "no host"),
])
def test_other_unsafe_urls_are_refused(url, reason):
    with pytest.raises(EgressRefused, match=reason):
        check_url(url, EgressPolicy())


def test_public_https_is_pinned_to_the_checked_address():
    target = check_url("https://8.8.8.8/score?x=1", EgressPolicy())
    assert target.pinned_url == "https://8.8.8.8:443/score?x=1" and target.host == "8.8.8.8"


def test_wrapped_public_ipv4_stays_public():
    for url in ("https://[64:ff9b::808:808]/", "https://[2002:808:808::1]/", "https://[::ffff:0:808:808]/"):
        assert check_url(url, EgressPolicy()).host


def test_an_allow_list_entry_with_a_port_covers_only_that_port():
    policy = EgressPolicy.from_setting("127.0.0.1:8000, 10.0.0.0/8:9000, [::1]:7000, localhost:81, fd00::/8")
    assert check_url("http://127.0.0.1:8000/x", policy).pinned_url == "http://127.0.0.1:8000/x"
    assert check_url("http://10.2.3.4:9000/x", policy) and check_url("http://[::1]:7000/x", policy)
    assert check_url("http://localhost:81/x", policy) and check_url("http://[fd00::5]:6379/x", policy)
    for url in ("http://127.0.0.1:6379/", "http://127.0.0.1/", "http://10.2.3.4:5432/", "http://[::1]:6379/",
                "http://localhost:6379/"):
        with pytest.raises(EgressRefused, match="non-public"):
            check_url(url, policy)


@pytest.mark.parametrize("entry", ["127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:70000", "[::1", "[::1]x", ":80"])
def test_a_malformed_allow_list_entry_fails_when_the_policy_is_built(entry):
    from service.settings import Settings

    with pytest.raises(ValueError, match="allow-list entry"):
        EgressPolicy.from_setting(entry)
    with pytest.raises(ValueError, match="allow-list entry"):
        Settings(egress_allow=entry)


def test_operators_can_allow_list_hosts_and_networks():
    assert check_url("http://127.0.0.1:9/x", EgressPolicy.from_setting("127.0.0.0/8")).host == "127.0.0.1"
    assert check_url("http://localhost:9/x", EgressPolicy.from_setting("localhost, 10.0.0.0/8"))
    with pytest.raises(EgressRefused):
        check_url("http://127.0.0.1:9/x", EgressPolicy.from_setting("10.0.0.0/8"))


class _Handler(QuietHandler):
    mode = "echo"

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.mode == "slow":
            time.sleep(2)
        if self.server.mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/")
            self.end_headers()
            return
        payload = {"echo": json.loads(body), "auth": self.headers.get("Authorization")}
        data = {"echo": json.dumps(payload).encode(), "garbage": b"<html>not json", "huge": b"[" + b"1," * 100000 + b"1]",
                "slow": b"{}"}[self.server.mode]
        self.answer(200, data, content_type=None)


@pytest.fixture
def server():
    with serving(_Handler) as srv:
        yield srv


def _call(server, mode, **policy):
    server.mode = mode
    pol = EgressPolicy.from_setting("127.0.0.1", **policy)
    return post_json(check_url(f"http://127.0.0.1:{server.server_port}/score", pol), {"a": 1}, pol,
                     headers={"Authorization": "Bearer s3cret"})


def test_post_json_round_trip_with_auth_header(server):
    assert _call(server, "echo") == {"echo": {"a": 1}, "auth": "Bearer s3cret"}


def test_timeouts_garbage_size_and_redirects(server):
    with pytest.raises(httpx.TimeoutException):
        _call(server, "slow", read_timeout_s=0.3)
    with pytest.raises(ValueError, match="not JSON"):
        _call(server, "garbage")
    with pytest.raises(EgressRefused, match="larger than"):
        _call(server, "huge", max_response_bytes=1000)
    with pytest.raises(httpx.HTTPStatusError, match="302"):
        _call(server, "redirect")


def test_a_bound_secret_goes_only_to_its_hosts_at_call_time(server):
    from service.egress import BoundSecret, bearer, host_matches

    server.mode = "echo"
    pol = EgressPolicy.from_setting("127.0.0.1")
    target = check_url(f"http://127.0.0.1:{server.server_port}/score", pol)
    sent = post_json(target, {"a": 1}, pol, headers={"Authorization": bearer(BoundSecret("s3cret", ["127.0.0.1"]))})
    assert sent["auth"] == "Bearer s3cret"
    for bound in (BoundSecret("s3cret", ["grader.example.com"]), BoundSecret("s3cret", [])):
        with pytest.raises(EgressRefused, match="may only be sent to"):
            post_json(target, {"a": 1}, pol, headers={"Authorization": bearer(bound)})
    assert host_matches("a.b.example.com", ["*.example.com"]) and not host_matches("example.com", ["*.example.com"])
    assert host_matches("Grader.Example.com.", ["grader.example.com"]) and not host_matches("evil.com", ["evil.co"])
