"""Fetching the images clients name by http(s) URL, only from where the operator allows.

Why: a server that fetches whatever URL a request names is a door into the operator's
network (SSRF: cloud metadata at 169.254.169.254, admin pages on localhost). So:

- URLs are refused unless --allow-image-urls lists hosts, and a URL's host must be listed
  (a name, `*.domain` for its subdomains, `*` for any, an IP address or a CIDR network);
- the name is resolved and every address must be public, unless the operator listed that
  address or a network holding it (`127.0.0.1`, `10.0.0.0/8`);
- the connection goes to an address that was checked, never to what the name resolves to
  a moment later, so DNS rebinding cannot swap in a private address; the Host header and
  the TLS certificate check still use the name;
- redirects are not followed (their target was never checked); the client is told to send
  the final URL;
- one deadline covers resolving, connecting and reading, and at most max_bytes + 1 bytes
  are read.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from server.errors import ApiError, bad_request


class ImageLimits(Protocol):
    """What a fetch reads of `server.images.ImageLimits` (not imported: it imports us)."""

    max_bytes: int
    url_hosts: tuple[str, ...]
    url_timeout_s: float


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ANY_HOST = "*"
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
_CHUNK = 1 << 16
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "tandem"}
_NOT_PUBLIC = ("loopback", "link_local", "unspecified", "multicast", "private", "reserved")


def parse_url_hosts(text: str) -> tuple[str, ...]:
    """The comma-separated entries of --allow-image-urls, normalised; ValueError on an
    entry that is not a host name, `*.domain`, `*`, an IP address or a CIDR network."""
    entries = tuple(_normal(entry) for entry in text.split(",") if entry.strip())
    HostRules.parse(entries)
    return entries


@dataclass(frozen=True)
class HostRules:
    """The operator's list, sorted by what each entry allows."""

    names: frozenset[str]
    domains: tuple[str, ...]
    """`.example.com` for `*.example.com`: the subdomains of example.com."""
    any_name: bool
    networks: tuple[IPNetwork, ...]
    """Listed networks, and listed addresses as /32 or /128 networks."""

    @classmethod
    def parse(cls, entries: tuple[str, ...]) -> HostRules:
        names: set[str] = set()
        domains: list[str] = []
        networks: list[IPNetwork] = []
        any_name = False
        for entry in map(_normal, entries):
            if entry == ANY_HOST:
                any_name = True
            elif entry.startswith(("*.", ".")) and _NAME.fullmatch(entry.lstrip("*.")):
                domains.append("." + entry.lstrip("*."))
            elif "/" in entry or _address(entry) is not None:
                networks.append(ipaddress.ip_network(entry, strict=False))
            elif _NAME.fullmatch(entry):
                names.add(entry)
            else:
                raise ValueError(
                    f"{entry!r} is not a host name, *.domain, IP address or CIDR network"
                )
        return cls(frozenset(names), tuple(domains), any_name, tuple(networks))

    def names_host(self, host: str) -> bool:
        """The URL's host (a name or an IP literal) is on the list."""
        address = _address(host)
        if address is not None:
            return self.any_name or self.lists_address(address)
        return self.any_name or host in self.names or host.endswith(self.domains)

    def lists_address(self, address: IPAddress) -> bool:
        unmapped = _unmapped(address)
        return any(a in network for network in self.networks for a in (address, unmapped))


async def fetch_image_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The body at `url`, at most limits.max_bytes long, from a listed host at a checked
    address, within limits.url_timeout_s; every refusal a 400."""
    if not limits.url_hosts:
        raise bad_request(
            f"{param} is an image URL, and this server does not fetch image URLs; send the "
            "image as base64 data, or start the server with --allow-image-urls HOST",
            param,
        )
    rules = HostRules.parse(limits.url_hosts)
    target = _target(url, rules, param)
    deadline = time.monotonic() + limits.url_timeout_s
    try:
        with anyio.fail_after(limits.url_timeout_s):
            addresses = await _resolve(target, param)
            _check_addresses(target, addresses, rules, param)
            return await anyio.to_thread.run_sync(
                _download, target, addresses, limits, param, deadline, abandon_on_cancel=True
            )
    except TimeoutError:
        raise _timed_out(target, limits, param) from None


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    path: str
    tls: bool


def _target(url: str, rules: HostRules, param: str) -> _Target:
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise bad_request(f"{param} is not a valid URL", param) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise bad_request(f"{param} must be an http(s) URL or a data: URL", param)
    host = _normal(parts.hostname or "")
    if not host:
        raise bad_request(f"{param} is a URL without a host", param)
    if not rules.names_host(host):
        raise bad_request(
            f"{param} names host {host}, which is not among the hosts this server fetches "
            "images from (--allow-image-urls)",
            param,
        )
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(host, port or (443 if scheme == "https" else 80), path, scheme == "https")


async def _resolve(target: _Target, param: str) -> list[str]:
    """The host's addresses, resolved off the event loop (getaddrinfo blocks)."""
    try:
        infos = await anyio.to_thread.run_sync(
            socket.getaddrinfo,
            target.host,
            target.port,
            0,
            socket.SOCK_STREAM,
            abandon_on_cancel=True,
        )
    except (OSError, UnicodeError) as exc:
        raise bad_request(f"{param}: could not resolve host {target.host} ({exc})", param) from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _check_addresses(target: _Target, addresses: list[str], rules: HostRules, param: str) -> None:
    for text in addresses:
        address = ipaddress.ip_address(text.split("%")[0])
        kind = _not_public(address)
        if kind and not rules.lists_address(address):
            raise bad_request(
                f"{param} names host {target.host}, which resolves to {address}, a {kind} "
                "address; the server fetches from such an address only when "
                "--allow-image-urls lists it or its network (e.g. 10.0.0.0/8)",
                param,
            )


def _not_public(address: IPAddress) -> str | None:
    """What kind of non-public address this is, or None for a public one."""
    address = _unmapped(address)
    for kind in _NOT_PUBLIC:
        if getattr(address, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if address.is_global else "non-public"


def _download(
    target: _Target, addresses: list[str], limits: ImageLimits, param: str, deadline: float
) -> bytes:
    """Runs in a worker thread; socket timeouts and the deadline bound it even after the
    awaiting request has given up on it."""
    try:
        with contextlib.closing(_PinnedConnection(target, addresses, limits.url_timeout_s)) as conn:
            conn.request("GET", target.path, headers=_HEADERS)
            response = conn.getresponse()
            _check_response(response, target, limits, param)
            return _read_capped(response, limits, param, deadline)
    except TimeoutError:
        raise _timed_out(target, limits, param) from None
    except (OSError, http.client.HTTPException) as exc:
        raise bad_request(
            f"{param}: could not fetch the image from {target.host} ({exc})", param
        ) from None


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to the checked addresses only; no proxy, no redirects."""

    def __init__(self, target: _Target, addresses: list[str], timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self.default_port = 443 if target.tls else 80  # so Host carries no default port
        self._addresses = addresses
        self._tls = ssl.create_default_context() if target.tls else None

    def connect(self) -> None:
        sock = self._connect_first()
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        self.sock = sock

    def _connect_first(self) -> socket.socket:
        error: OSError = OSError(f"no address for {self.host}")
        for address in self._addresses:
            try:
                return socket.create_connection((address, self.port), self.timeout)
            except OSError as exc:
                error = exc
        raise error


def _check_response(
    response: http.client.HTTPResponse, target: _Target, limits: ImageLimits, param: str
) -> None:
    status = response.status
    if 300 <= status < 400:
        location = response.getheader("Location")
        raise bad_request(
            f"{param}: {target.host} answered with a redirect (HTTP {status}"
            f"{f' to {location}' if location else ''}); redirects are not followed, "
            "send the image's final URL",
            param,
        )
    if status != 200:
        raise bad_request(
            f"{param}: {target.host} answered HTTP {status} {response.reason} for the image",
            param,
        )
    content_type = response.getheader("Content-Type")
    if content_type and not content_type.strip().lower().startswith("image/"):
        raise bad_request(
            f"{param}: {target.host} sent Content-Type {content_type!r}, not an image", param
        )
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > limits.max_bytes:
        raise _too_many_bytes(f"{length} bytes", limits, param)


def _read_capped(
    response: http.client.HTTPResponse, limits: ImageLimits, param: str, deadline: float
) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = response.read1(min(_CHUNK, limits.max_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limits.max_bytes:
            raise _too_many_bytes(f"more than {limits.max_bytes} bytes", limits, param)


def _too_many_bytes(size: str, limits: ImageLimits, param: str) -> ApiError:
    return bad_request(
        f"{param} is an image of {size}, over the {limits.max_bytes}-byte limit of one image "
        "(--max-image-bytes)",
        param,
    )


def _timed_out(target: _Target, limits: ImageLimits, param: str) -> ApiError:
    return bad_request(
        f"{param}: fetching the image from {target.host} took longer than "
        f"{limits.url_timeout_s:g} s (--image-url-timeout)",
        param,
    )


def _normal(entry: str) -> str:
    return entry.strip().lower().strip("[]").rstrip(".")


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) is judged as the IPv4 it maps."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address
