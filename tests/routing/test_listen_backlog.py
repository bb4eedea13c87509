"""The router listens with a deep accept queue: Twisted's default (50) overflowed when 1,000
streams connected at once, and the clients whose connections overflowed it were reset."""

import pytest
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor

from apps.routing.process import LISTEN_BACKLOG, listen_endpoint


def test_router_listens_with_a_deep_backlog():
    reactor = MemoryReactor()
    serverFromString(reactor, listen_endpoint("127.0.0.1", 30123)).listen(Factory())
    [(port, _factory, backlog, interface)] = reactor.tcpServers
    assert (port, interface) == (30123, "127.0.0.1")
    assert backlog == LISTEN_BACKLOG >= 1024


def test_workers_listen_each_on_a_socket_of_its_own_and_connections_spread_over_them():
    """``--workers N``: one socket a worker on the same port (SO_REUSEPORT), so that a burst of
    connections is spread by the kernel, not taken whole by whichever worker woke first."""
    import select
    import socket

    from apps.routing.process import listening_sockets

    socks = listening_sockets("127.0.0.1", 0, 2)
    clients = []
    try:
        assert len({id(s) for s in socks}) == 2
        assert len({s.getsockname() for s in socks}) == 1  # one port
        for s in socks:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            s.setblocking(False)
        clients = [socket.create_connection(socks[0].getsockname()) for _ in range(64)]
        accepted = [0, 0]
        while sum(accepted) < 64:
            ready, _, _ = select.select(socks, [], [], 5)
            assert ready, accepted
            for s in ready:
                while True:
                    try:
                        conn, _ = s.accept()
                    except BlockingIOError:
                        break
                    conn.close()
                    accepted[socks.index(s)] += 1
        assert min(accepted) >= 8, accepted  # (all on one: a chance of 2^-63)
        # a second router's workers cannot join the port unseen: it is in use, as without them
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", socks[0].getsockname()[1], 2)
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()
