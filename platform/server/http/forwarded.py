"""Who is really calling, and over what, when the server sits behind reverse proxies.

The ASGI peer address is the client unless it is one of `Settings.trusted_proxies` (addresses or CIDR
networks): only then are `X-Forwarded-For` and `X-Forwarded-Proto` believed, since anyone else can write
them. `X-Forwarded-For` is read from the right (each proxy appends the address it saw), skipping trusted
proxies, so the first untrusted address is the client, whatever a client put at the left.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.datastructures import Headers

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
UNKNOWN_CLIENT = "unknown"


def parse_trusted_proxies(spec: str) -> tuple[Network, ...]:
    """`"10.0.0.0/8, 192.168.1.7"` -> networks; raise ValueError naming a bad entry."""
    networks = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"LORAMUX_TRUSTED_PROXIES entry {entry!r} is not an IP address or network") from None
    return tuple(networks)


def _trusted(address: str, proxies: Iterable[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in proxies)


def _peer(scope) -> str:
    client = scope.get("client")
    return client[0] if client else UNKNOWN_CLIENT


def client_address(scope, proxies: tuple[Network, ...]) -> str:
    """The address of the client that sent this request (see the module docstring)."""
    address = _peer(scope)
    if not proxies or not _trusted(address, proxies):
        return address
    hops = [h.strip() for h in ",".join(Headers(scope=scope).getlist("x-forwarded-for")).split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, proxies):
            return hop
        address = hop
    return address  # every hop is a trusted proxy: the leftmost one is as close to the client as we know


def request_scheme(scope, proxies: tuple[Network, ...]) -> str:
    """"https" or "http" as the client used it: the last `X-Forwarded-Proto` a trusted proxy set, else
    the scheme the server itself saw."""
    scheme = scope.get("scheme", "http")
    if proxies and _trusted(_peer(scope), proxies):
        forwarded = Headers(scope=scope).get("x-forwarded-proto")
        if forwarded:
            scheme = forwarded.split(",")[-1].strip().lower()
    return "https" if scheme in ("https", "wss") else "http"
