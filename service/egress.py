"""Outbound HTTP to user-named endpoints (remote rewards, environments, judges), safely.

A user who can make the service fetch a URL can aim it at the service's own
neighbours: Redis and PostgreSQL on loopback, the cloud metadata endpoint,
the private network (OWASP API7, SSRF). So every URL is resolved once, every
address it resolves to must be public, and the connection goes to that
pinned address (no second lookup an attacker could rebind). Operators can
allow-list hosts or networks (tests allow loopback this way). Redirects are
not followed, and responses are read up to a cap.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx


class EgressRefused(ValueError):
    """The URL may not be fetched; the message says why."""


def host_matches(host: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """`host` is one of the patterns: an exact name or address, or '*.domain' for any subdomain."""
    host = host.lower().rstrip(".")
    for pattern in patterns:
        pattern = pattern.lower().rstrip(".")
        if host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


class BoundSecret(str):
    """A secret's value that knows the only hosts it may be sent to.

    A str, so reward and environment code pass it around (into headers) like
    any value; post_json() refuses to send a header holding one to another
    host. The API checks the binding when a spec is registered; this is the
    check at call time, in the worker, after DNS and specs had time to change.
    """

    hosts: tuple[str, ...]

    def __new__(cls, value: str, hosts) -> "BoundSecret":
        bound = super().__new__(cls, value)
        bound.hosts = tuple(hosts)
        return bound

    def prefixed(self, prefix: str) -> "BoundSecret":
        """e.g. 'Bearer ' + the secret, still bound (an f-string would lose the binding)."""
        return BoundSecret(prefix + self, self.hosts)


def bearer(value: str) -> str:
    return value.prefixed("Bearer ") if isinstance(value, BoundSecret) else f"Bearer {value}"


def _check_secret_hosts(target: "Target", headers: dict[str, str]) -> None:
    for name, value in headers.items():
        if isinstance(value, BoundSecret) and not host_matches(target.host, value.hosts):
            raise EgressRefused(f"{target.url}: the secret in header {name!r} may only be sent to "
                                f"{', '.join(value.hosts)}, not to {target.host}")


@dataclass(frozen=True)
class EgressPolicy:
    allow: tuple[str, ...] = ()  # hostnames, IP addresses or CIDR networks exempt from the public-address rule
    require_https: bool = True  # plain http only for allow-listed hosts
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_response_bytes: int = 1 << 20

    @classmethod
    def from_setting(cls, allow: str, **kw) -> "EgressPolicy":
        return cls(allow=tuple(a.strip() for a in allow.split(",") if a.strip()), **kw)

    def _allowed(self, host: str, ip: ipaddress._BaseAddress) -> bool:
        for entry in self.allow:
            if entry.lower() == host.lower():
                return True
            try:
                if ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
        return False


@dataclass(frozen=True)
class Target:
    url: str  # the original URL
    host: str
    pinned_url: str  # the same URL with the host replaced by the checked address


def _is_public(ip: ipaddress._BaseAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_url(url: str, policy: EgressPolicy) -> Target:
    """Resolve and vet a URL; raises EgressRefused naming the reason."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise EgressRefused(f"{url!r}: only http(s) URLs are allowed")
    if not parts.hostname:
        raise EgressRefused(f"{url!r}: no host")
    if parts.username or parts.password:
        raise EgressRefused(f"{url!r}: credentials in the URL are not allowed; use the secret header")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise EgressRefused(f"{url!r}: cannot resolve {host} ({e.strerror})") from None
    ips = sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)
    for ip in ips:
        if not _is_public(ip) and not policy._allowed(host, ip):
            raise EgressRefused(f"{url!r}: {host} resolves to {ip}, a non-public address "
                                "(loopback, private, link-local or reserved); an operator can allow-list it")
    allowed = all(policy._allowed(host, ip) for ip in ips)
    if policy.require_https and parts.scheme != "https" and not allowed:
        raise EgressRefused(f"{url!r}: https is required")
    pinned_host = f"[{ips[0]}]" if ips[0].version == 6 else str(ips[0])
    pinned = urlunsplit((parts.scheme, f"{pinned_host}:{port}", parts.path, parts.query, ""))
    return Target(url=url, host=host, pinned_url=pinned)


def post_json(target: Target, payload: object, policy: EgressPolicy, *, headers: dict[str, str] | None = None,
              client: httpx.Client | None = None) -> object:
    """POST JSON to a checked target and parse the JSON answer, within the policy's time and size caps."""
    _check_secret_hosts(target, headers or {})
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    all_headers = {"Host": target.host, "Content-Type": "application/json", **(headers or {})}
    own = client is None
    client = client or httpx.Client(timeout=timeout, follow_redirects=False)
    try:
        with client.stream("POST", target.pinned_url, content=json.dumps(payload).encode(), headers=all_headers,
                           timeout=timeout, extensions={"sni_hostname": target.host}) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > policy.max_response_bytes:
                    raise EgressRefused(f"{target.url}: response larger than {policy.max_response_bytes} bytes")
            if response.status_code >= 300:
                raise httpx.HTTPStatusError(f"{target.url}: HTTP {response.status_code}", request=response.request,
                                            response=response)
    finally:
        if own:
            client.close()
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{target.url}: the response is not JSON ({e})") from None


def post_bytes(target: Target, body: bytes, policy: EgressPolicy, *, headers: dict[str, str]) -> int:
    """POST a body to a checked target and return the status; the answer is read up to the cap and dropped."""
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    with httpx.Client(timeout=timeout, follow_redirects=False) as client:
        with client.stream("POST", target.pinned_url, content=body, headers={"Host": target.host, **headers},
                           extensions={"sni_hostname": target.host}) as response:
            read = 0
            for chunk in response.iter_bytes():
                read += len(chunk)
                if read > policy.max_response_bytes:
                    break
            return response.status_code
