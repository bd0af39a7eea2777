"""A free TCP port on the loopback interface for tests that must name one up front.

torchrun's static rendezvous (``--master-addr/--master-port``) takes a port number before rank 0's
TCPStore binds it, so the port is released here and bound again there: another process could take
it in between. The tests that use this exist to exercise that static path as users type it; the
other scaling tests use the default rendezvous, which needs no port.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
