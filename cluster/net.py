"""Where a listener or a cluster can be reached from: shared by the servers' and the Ray runtime's warnings."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Only this machine reaches ``host`` (a host name other than localhost may resolve to any interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
