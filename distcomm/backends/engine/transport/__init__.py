"""Moving headed messages between the ranks of a group: the Transport contract and TCP.

`base.Transport` is the contract; `tcp.TcpTransport` implements it for one group as a
channel on the process's `fabric.Fabric` (one I/O thread and one connection per peer
process, made on first use and shared by every group; `dial` makes the connections,
`conn` writes frames on them, `reader` reads them); `links` watches the connections;
`mailbox` matches receives to messages; `exchange.Exchange` is a collective's view of a
transport.
"""

from .base import Transport
from .exchange import Exchange, SubExchange
from .mailbox import Mailbox
from .tcp import TcpTransport

__all__ = ["Exchange", "Mailbox", "SubExchange", "TcpTransport", "Transport"]
