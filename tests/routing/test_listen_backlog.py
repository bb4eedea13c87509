"""The router listens with a deep accept queue: Twisted's default (50) overflowed when 1,000
streams connected at once, and the clients whose connections overflowed it were reset."""

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
