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
class AllowEntry:
    """One allow-list entry: a hostname, an address or a network, optionally limited to one port."""

    host: str  # a lower-case name, an address or a CIDR network
    port: int | None = None  # None: every port

    @classmethod
    def parse(cls, text: str) -> "AllowEntry":
        """'host', 'host:port', '10.0.0.0/8:8000', 'fd00::/8' or '[fd00::1]:8000' (brackets when a v6 has a port)."""
        text = text.strip().lower()
        host, port = text, None
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"egress allow-list entry {text!r}: expected [ipv6]:port")
            port = rest[1:] or None
        elif text.count(":") == 1:  # more than one colon is a bare IPv6 address or network, with no port
            host, port = text.split(":")
        if not host:
            raise ValueError(f"egress allow-list entry {text!r}: no host")
        if port is None:
            return cls(host.rstrip("."))
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"egress allow-list entry {text!r}: the port must be a number from 1 to 65535")
        return cls(host.rstrip("."), int(port))

    def network(self) -> ipaddress._BaseNetwork | None:
        try:
            return ipaddress.ip_network(self.host, strict=False)
        except ValueError:
            return None

    def covers(self, host: str, ip: ipaddress._BaseAddress, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.host == host.lower().rstrip("."):
            return True
        network = self.network()
        embedded = _embedded_ipv4(ip)
        return network is not None and (ip in network or (embedded is not None and embedded in network))


@dataclass(frozen=True)
class EgressPolicy:
    # Hostnames, IP addresses or CIDR networks exempt from the public-address rule, each optionally with
    # ':port' (else every port of it is reachable, e.g. Redis's next to the grader you meant).
    allow: tuple[str, ...] = ()
    require_https: bool = True  # plain http only for allow-listed hosts
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_response_bytes: int = 1 << 20

    def __post_init__(self):
        for entry in self.allow:
            AllowEntry.parse(entry)  # a typo fails when the policy is built, not silently at call time

    @classmethod
    def from_setting(cls, allow: str, **kw) -> "EgressPolicy":
        return cls(allow=tuple(a.strip() for a in allow.split(",") if a.strip()), **kw)

    def _allowed(self, host: str, ip: ipaddress._BaseAddress, port: int) -> bool:
        return any(AllowEntry.parse(entry).covers(host, ip, port) for entry in self.allow)


@dataclass(frozen=True)
class Target:
    url: str  # the original URL
    host: str
    pinned_url: str  # the same URL with the host replaced by the checked address


# IPv6 forms that carry an IPv4 address a gateway or the kernel may deliver to: NAT64's well-known prefix
# (RFC 6052) and the local-use one (RFC 8215), SIIT's IPv4-translated ::ffff:0:a.b.c.d (RFC 2765), and the
# deprecated IPv4-compatible ::a.b.c.d. Python calls them global, so 64:ff9b::7f00:1 or ::ffff:0:7f00:1 would
# pass as a public address while a translator delivers to 127.0.0.1.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # ::ffff:0:0/96 is the mapped range
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip: ipaddress._BaseAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address wraps (mapped, translated, 6to4, NAT64, IPv4-compatible), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped:
        return ip.ipv4_mapped
    if ip.sixtofour:
        return ip.sixtofour
    if ip in _NAT64 or ip in _IPV4_TRANSLATED or ip in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _is_public(ip: ipaddress._BaseAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip in _NAT64_LOCAL:
        return False  # where its IPv4 sits depends on the operator's prefix length: never public
    embedded = _embedded_ipv4(ip)
    if embedded is not None and not (embedded.is_global and not embedded.is_multicast):
        return False
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
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise EgressRefused(f"{url!r}: the port is not a number from 1 to 65535") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise EgressRefused(f"{url!r}: cannot resolve {host} ({e.strerror})") from None
    ips = sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)
    for ip in ips:
        if not _is_public(ip) and not policy._allowed(host, ip, port):
            raise EgressRefused(f"{url!r}: {host} resolves to {ip}, a non-public address "
                                "(loopback, private, link-local or reserved); an operator can allow-list it "
                                "(host or host:port)")
    allowed = all(policy._allowed(host, ip, port) for ip in ips)
    if policy.require_https and parts.scheme != "https" and not allowed:
        raise EgressRefused(f"{url!r}: https is required")
    pinned_host = f"[{ips[0]}]" if ips[0].version == 6 else str(ips[0])
    pinned = urlunsplit((parts.scheme, f"{pinned_host}:{port}", parts.path, parts.query, ""))
    return Target(url=url, host=host, pinned_url=pinned)


def _exchange(method: str, target: Target, content: bytes | None, policy: EgressPolicy, headers: dict[str, str],
              client: httpx.Client | None) -> tuple[httpx.Response, bytes]:
    """One request to the pinned address (redirects are answers, never followed), its body read up to the cap."""
    _check_secret_hosts(target, headers)
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    all_headers = {"Host": target.host, **({"Content-Type": "application/json"} if content is not None else {}),
                   **headers}
    own = client is None
    client = client or httpx.Client(timeout=timeout, follow_redirects=False)
    try:
        with client.stream(method, target.pinned_url, content=content, headers=all_headers, timeout=timeout,
                           follow_redirects=False, extensions={"sni_hostname": target.host}) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > policy.max_response_bytes:
                    raise EgressRefused(f"{target.url}: response larger than {policy.max_response_bytes} bytes")
    finally:
        if own:
            client.close()
    return response, bytes(body)


def post_json(target: Target, payload: object, policy: EgressPolicy, *, headers: dict[str, str] | None = None,
              client: httpx.Client | None = None) -> object:
    """POST JSON to a checked target and parse the JSON answer, within the policy's time and size caps."""
    response, body = _exchange("POST", target, json.dumps(payload).encode(), policy, headers or {}, client)
    if response.status_code >= 300:
        raise httpx.HTTPStatusError(f"{target.url}: HTTP {response.status_code}", request=response.request,
                                    response=response)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{target.url}: the response is not JSON ({e})") from None


def request_json(method: str, url: str, policy: EgressPolicy, *, payload: object = None,
                 headers: dict[str, str] | None = None, client: httpx.Client | None = None) -> tuple[int, object]:
    """(status, parsed JSON or None) of one request to `url`, resolved and vetted now, at connect time.

    For clients that talk to one user-named server for a long while (a tracking server): each request is checked
    again, so a name that later resolves to a private address (DNS rebinding) or an operator's narrower policy
    takes effect, and the connection goes to the address just checked. A 3xx is returned, not followed. The
    caller reads the answer; it must not pass the body on to users (it is whatever the server chose to send).
    """
    target = check_url(url, policy)
    content = None if payload is None else json.dumps(payload).encode()
    response, body = _exchange(method, target, content, policy, headers or {}, client)
    try:
        return response.status_code, json.loads(body) if body else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return response.status_code, None


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
