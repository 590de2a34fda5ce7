"""Where a target finds its drafters: `--drafter host:port[,host:port...]` or `dns:///host:port`.

A DNS name may resolve to several drafters (a headless Kubernetes Service gives one address per
pod), and the answer changes as they come and go, so it is resolved again before every connect.
The link holds one stream to one drafter and moves on to the next when that one fails.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

DNS_SCHEME = "dns:///"


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One drafter to try: its address, and the name its certificate carries when DNS gave the address."""

    address: str
    server_name: str = ""


def _endpoint(text: str, flag: str) -> HostPort:
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {text.strip()!r} is not host:port (port 1 to 65535)")
    return HostPort(host, int(port))


@dataclass(frozen=True, slots=True)
class DrafterAddresses:
    """The drafters a target may use, in the order given; `dns` names resolve to several."""

    endpoints: tuple[HostPort, ...]
    dns: bool = False

    @classmethod
    def parse(cls, spec: str, flag: str = "--drafter") -> "DrafterAddresses":
        if spec.startswith(DNS_SCHEME):
            return cls((_endpoint(spec[len(DNS_SCHEME):], flag),), dns=True)
        if "://" in spec:
            raise ValueError(f"{flag}: only the dns:/// scheme is known, got {spec!r}")
        return cls(tuple(_endpoint(part, flag) for part in spec.split(",")))

    async def resolve(self) -> list[Candidate]:
        """Every drafter to try now; a DNS name that resolves to nothing gives none."""
        if not self.dns:
            return [Candidate(e.address) for e in self.endpoints]
        [name] = self.endpoints
        try:
            answers = await asyncio.get_running_loop().getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        hosts = dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in answers)  # unique, in DNS order
        return [Candidate(HostPort(host, name.port).address, name.host) for host in hosts]
