"""Egress edges the main tests leave open (found by mutation testing, bench/mutate.py): pattern matching,
allow-list parsing, default ports and IPv6 pinning, and exactly what post_json / post_bytes send and accept.

What goes over the wire is read from a real loopback server, or, for the timeouts and the TLS server name
that never reach a plain-HTTP server, from httpx's transport (the outer edge).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from service.egress import (
    BoundSecret,
    EgressPolicy,
    EgressRefused,
    bearer,
    check_url,
    host_matches,
    post_bytes,
    post_json,
)
from tests.loopback_http import QuietHandler, serving


def test_host_patterns_match_whole_labels_only():
    assert host_matches("api.example.com", ["*.example.com"])
    assert not host_matches("badexample.com", ["*.example.com"])  # a suffix, not a subdomain
    assert not host_matches("example.com.evil.net", ["*.example.com"])
    assert host_matches("grader.example.com", ["other.org", "Grader.Example.COM."])  # any pattern, normalised
    assert not host_matches("grader.example.com", [])


def test_bearer_of_a_plain_value_and_of_a_bound_secret():
    assert bearer("tok") == "Bearer tok" and not isinstance(bearer("tok"), BoundSecret)
    bound = bearer(BoundSecret("tok", ["a.example"]))
    assert bound == "Bearer tok" and isinstance(bound, BoundSecret) and bound.hosts == ("a.example",)
    target = check_url("https://8.8.8.8/x", EgressPolicy())  # refused before anything is sent
    with pytest.raises(EgressRefused, match="header 'X-Auth' may only be sent to a.example, b.example, not to 8.8.8.8"):
        post_json(target, {}, EgressPolicy(), headers={"X-Auth": BoundSecret("tok", ["a.example", "b.example"])})


def test_allow_list_entries_are_trimmed_case_blind_and_bad_ones_skipped():
    policy = EgressPolicy.from_setting(" not-a-network , LOCALHOST,, 127.0.0.1/8 ")
    assert policy.allow == ("not-a-network", "LOCALHOST", "127.0.0.1/8")
    assert check_url("http://127.0.0.2:9/x", policy).pinned_url == "http://127.0.0.2:9/x"  # host bits: not strict
    assert check_url("http://localhost:9/x", EgressPolicy.from_setting("Localhost")).host == "localhost"


def test_default_ports_fragments_and_ipv6_pinning():
    plain = EgressPolicy(require_https=False)
    assert check_url("http://8.8.8.8/a?b=1#frag", plain).pinned_url == "http://8.8.8.8:80/a?b=1"
    assert check_url("https://8.8.8.8:8443/a", EgressPolicy()).pinned_url == "https://8.8.8.8:8443/a"
    target = check_url("https://[2001:4860:4860::8888]/x", EgressPolicy())
    assert target.pinned_url == "https://[2001:4860:4860::8888]:443/x" and target.host == "2001:4860:4860::8888"


def test_a_user_name_or_a_password_alone_is_refused_and_the_refusal_says_why():
    for url in ("https://user@8.8.8.8/", "https://:pw@8.8.8.8/"):
        with pytest.raises(EgressRefused, match="credentials in the URL"):
            check_url(url, EgressPolicy())
    with pytest.raises(EgressRefused, match=r"resolves to 10.1.2.3, a non-public address \(loopback, private, "
                                            r"link-local or reserved\); an operator can allow-list it"):
        check_url("https://10.1.2.3/", EgressPolicy())
    assert check_url("https://8.8.8.8/a", EgressPolicy()).url == "https://8.8.8.8/a"


def test_global_multicast_and_unresolvable_hosts_are_refused():
    for url in ("https://[ff0e::1]/", "https://224.0.1.1/"):  # is_global, but multicast
        with pytest.raises(EgressRefused, match="non-public"):
            check_url(url, EgressPolicy())
    with pytest.raises(EgressRefused, match="cannot resolve nothing.invalid"):
        check_url("https://nothing.invalid/", EgressPolicy())


def test_plain_http_needs_every_address_allow_listed(monkeypatch):
    """A name that resolves to an allow-listed and a public address is not exempt from https."""
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 80)) for ip in ("10.0.0.5", "8.8.8.8")]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)  # DNS: the outer edge
    with pytest.raises(EgressRefused, match="https is required"):
        check_url("http://grader.example/x", EgressPolicy.from_setting("10.0.0.0/8"))
    target = check_url("https://grader.example/x", EgressPolicy.from_setting("10.0.0.0/8"))
    assert target.pinned_url == "https://10.0.0.5:443/x"  # the first address, in a stable order
    assert check_url("http://grader.example/x", EgressPolicy.from_setting("10.0.0.0/8, 8.8.8.8")).host


# -- what is sent and accepted --------------------------------------------------------------------------


class _Handler(QuietHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append((self.path, dict(self.headers), body))
        self.answer(*self.server.answer, content_type=None)


@pytest.fixture
def server():
    with serving(_Handler) as srv:
        srv.seen, srv.answer = [], (200, b"{}")
        yield srv


def _target(server, path="/score?x=1"):
    policy = EgressPolicy.from_setting("127.0.0.1", max_response_bytes=10)
    return check_url(f"http://127.0.0.1:{server.server_port}{path}", policy), policy


def test_post_json_sends_the_payload_host_and_headers(server):
    target, policy = _target(server)
    server.answer = (299, b'{"ok": 1}')  # any 2xx is an answer
    assert post_json(target, {"a": [1, 2]}, policy, headers={"X-Key": "k"}) == {"ok": 1}
    path, headers, body = server.seen[-1]
    assert path == "/score?x=1" and json.loads(body) == {"a": [1, 2]}
    assert headers["Host"] == "127.0.0.1" and headers["Content-Type"] == "application/json"
    assert headers["X-Key"] == "k"
    assert post_json(target, None, policy) == {"ok": 1} and server.seen[-1][2] == b"null"


def test_post_json_reads_exactly_up_to_the_cap_and_refuses_3xx(server):
    target, policy = _target(server)
    server.answer = (200, b'"12345678"')  # 10 bytes: the cap
    assert post_json(target, {}, policy) == "12345678"
    server.answer = (200, b'"123456789"')
    with pytest.raises(EgressRefused, match="larger than 10 bytes"):
        post_json(target, {}, policy)
    server.answer = (300, b"{}")
    with pytest.raises(httpx.HTTPStatusError, match="HTTP 300") as info:
        post_json(target, {}, policy)
    # the retry rules (worker/rewards/remote.py, worker/envs/http_env.py) read the status from the error
    assert info.value.response.status_code == 300 and info.value.request.url.path == "/score"


def test_post_json_joins_an_answer_that_arrives_in_many_chunks(server):
    target, _ = _target(server)
    big = list(range(100_000))  # about 600 KB: many reads
    server.answer = (200, json.dumps(big).encode())
    assert post_json(target, {}, EgressPolicy.from_setting("127.0.0.1")) == big


def test_post_json_uses_the_policys_timeouts_and_sni_and_leaves_a_given_client_open():
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    client = httpx.Client(transport=httpx.MockTransport(answer))
    policy = EgressPolicy(connect_timeout_s=1.5, read_timeout_s=7.0)
    target = check_url("https://8.8.8.8/score", policy)
    assert post_json(target, {}, policy, client=client) == {"ok": True}
    assert post_json(target, {}, policy, client=client) == {"ok": True}  # still open: the caller owns it
    request = seen[-1]
    assert request.extensions["timeout"] == {"connect": 1.5, "read": 7.0, "write": 7.0, "pool": 7.0}
    assert request.extensions["sni_hostname"] == "8.8.8.8" and str(request.url) == "https://8.8.8.8/score"
    client.close()


def test_post_bytes_returns_the_status_sends_the_host_and_drops_the_answer(server):
    target, policy = _target(server, "/hook")
    server.answer = (204, b"")
    assert post_bytes(target, b"payload", policy, headers={"X-Sig": "s"}) == 204
    path, headers, body = server.seen[-1]
    assert (path, body, headers["Host"], headers["X-Sig"]) == ("/hook", b"payload", "127.0.0.1", "s")
    server.answer = (500, b"x" * 100)  # longer than the cap: read up to it, then dropped
    assert post_bytes(target, b"", policy, headers={}) == 500


def test_post_bytes_uses_the_policys_timeouts_and_sni(monkeypatch):
    seen = []
    real_client = httpx.Client

    def client(**kwargs):
        seen.append(kwargs)
        return real_client(transport=httpx.MockTransport(lambda r: (seen.append(r), httpx.Response(202))[1]),
                           **kwargs)

    monkeypatch.setattr(httpx, "Client", client)
    policy = EgressPolicy(connect_timeout_s=1.5, read_timeout_s=7.0)
    assert post_bytes(check_url("https://8.8.8.8/hook", policy), b"{}", policy, headers={}) == 202
    options, request = seen
    assert options["follow_redirects"] is False
    assert request.extensions["timeout"] == {"connect": 1.5, "read": 7.0, "write": 7.0, "pool": 7.0}
    assert request.extensions["sni_hostname"] == "8.8.8.8"
