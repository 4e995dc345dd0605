"""Host-header check for servers without API keys: the defence against DNS rebinding.

A web page the operator visits can point its own domain name at 127.0.0.1 and then
read a keyless loopback server's answers as same-origin. The browser still sends the
page's name as Host, so a keyless server answers only Host names it knows: loopback
names, the names given with --allowed-hosts, and IP addresses (a name-less Host cannot
be rebound). Anything else gets 421. Keyed servers need no such check: the page has no
key.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError, error_response_for

LOOPBACK_NAMES = ("localhost",)
ANY_HOST = "*"


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """`name` is an IP address, localhost (or a subdomain of it), or in `allowed`
    (`.example.com` allows the domain and its subdomains; `*` allows any)."""
    name = name.rstrip(".")
    if ANY_HOST in allowed or is_ip_address(name):
        return True
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if name == entry or (entry.startswith(".") and (name.endswith(entry) or name == entry[1:])):
            return True
    return False


class HostCheck:
    """Answer 421 (in the path's API shape) to a request whose Host is not allowed."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_allowed(host_name(header), self.allowed):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            421,
            "this server does not answer to that Host name; start it with "
            "--allowed-hosts NAME, or with an API key",
            "invalid_request_error",
            code="host_not_allowed",
        )
        await error_response_for(scope["path"], error)(scope, receive, send)
