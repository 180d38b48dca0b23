"""Moving headed messages between the ranks of a group: the Transport contract and TCP.

`base.Transport` is the contract; `tcp.TcpTransport` implements it over one connection
per pair of ranks, which `mesh.connect_mesh` sets up through the store; `mailbox`
matches receives to messages; `exchange.Exchange` is a collective's view of a transport.
"""

from .base import Transport
from .exchange import Exchange, SubExchange
from .mailbox import Mailbox
from .tcp import TcpTransport

__all__ = ["Exchange", "Mailbox", "SubExchange", "TcpTransport", "Transport"]
