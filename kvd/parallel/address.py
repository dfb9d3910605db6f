"""Where the ranks meet: --distributed-init's tcp://HOST:PORT, whether it stays on this host, and the network
interface the process group's own sockets (gloo, NCCL) are pinned to afterwards."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvd.parallel.errors import DistributedStartupError

logger = logging.getLogger("kvd.parallel")

# The variables gloo and NCCL read for the interface they bind and connect on; an operator's value wins.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")


@dataclass(frozen=True)
class Rendezvous:
    """tcp://HOST:PORT as given; address() is HOST resolved (the one address rank 0 binds)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def addresses(self) -> list[str]:
        """Every address HOST resolves to (none: it does not resolve)."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        return list(dict.fromkeys(info[4][0] for info in infos))

    def is_loopback(self) -> bool:
        addresses = self.addresses()
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)

    def address(self) -> str:
        addresses = self.addresses()
        if not addresses:
            raise DistributedStartupError(f"--distributed-init {self.url}: {self.host!r} does not resolve")
        return addresses[0]


def parse_init(init: str) -> Rendezvous:
    """tcp://HOST:PORT -> Rendezvous; a wildcard HOST is refused: rank 0 binds exactly the address given."""
    url = urlsplit(init)
    if url.scheme != "tcp" or not url.hostname or url.port is None or url.path not in ("", "/"):
        raise DistributedStartupError(f"--distributed-init {init!r} is not tcp://HOST:PORT")
    if url.hostname in ("0.0.0.0", "::", "*"):
        raise DistributedStartupError(
            f"--distributed-init {init}: name the address the other ranks reach (rank 0 listens on it alone), "
            "not a wildcard"
        )
    return Rendezvous(url.hostname, url.port)


def remote_refusal(init: str | None, allow_remote: bool) -> str | None:
    """Why `init` may not be used (a non-loopback address without the operator's consent); None: it may.

    The rendezvous is authenticated, but the process group's traffic after it (every step's tokens, every
    activation) is neither encrypted nor authenticated: it belongs on loopback or a trusted network only."""
    if init is None or allow_remote:
        return None
    try:
        rendezvous = parse_init(init)
    except DistributedStartupError as e:
        return str(e)
    if rendezvous.is_loopback():
        return None
    return (
        f"--distributed-init {init} is not a loopback address and the ranks' traffic is not encrypted: pass "
        "--distributed-allow-remote on a trusted network (with --distributed-secret-file on every rank)"
    )


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_interfaces(local_address: str) -> str | None:
    """Make gloo and NCCL use the interface of `local_address` (where this rank met the others) unless the
    operator chose one; the interface, or None when none has that address (then they pick their own)."""
    name = interface_of(local_address)
    if name is None:
        logger.warning(
            "no network interface has %s: gloo and NCCL choose theirs (set %s to pin it)",
            local_address,
            " / ".join(INTERFACE_VARIABLES),
        )
        return None
    for variable in INTERFACE_VARIABLES:
        os.environ.setdefault(variable, name)
    return name


def interface_of(address: str) -> str | None:
    """The name of the interface holding `address` (any loopback address: the loopback interface)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name, held in _interface_addresses(ip.version):
        if held == ip or (ip.is_loopback and held.is_loopback):
            return name
    return None


def _interface_addresses(version: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    if version == 6:
        if not _IF_INET6.exists():
            return []
        # Each line: address (32 hex digits), index, prefix length, scope, flags, name.
        return [
            (fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            for fields in (line.split() for line in _IF_INET6.read_text().splitlines())
            if len(fields) == 6
        ]
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            found.append((name, ipaddress.IPv4Address(reply[20:24])))
    return found
