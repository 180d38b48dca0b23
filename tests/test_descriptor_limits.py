"""Running out of file descriptors: the soft limit is raised where a group may need more,
and a socket that cannot be made says which limit, how many are open and `ulimit -n`.

Each case runs in a child process, which lowers its own limits (a hard limit lowered
cannot be raised again) and fills its descriptor table for real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_FILL = """
import os, resource, socket
from distcomm import net
from distcomm.deadline import Deadline
from distcomm.errors import DistNetworkError

resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
listener = net.listen("127.0.0.1", 0)
port = listener.getsockname()[1]
held = []
while True:  # fill the table to its last descriptor
    try:
        held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
for what, call in (("connect", lambda: net.connect("127.0.0.1", port, Deadline(5.0), "rank 1")),
                   ("listen", lambda: net.listen("127.0.0.1", 0))):
    try:
        call()
    except DistNetworkError as exc:
        print(what, "|", exc)
    else:
        print(what, "| no error")
"""

_RESERVE = """
import logging, resource
from distcomm import net

logging.basicConfig(level=logging.WARNING, format="%(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 4096))
net.reserve_descriptors(1000, "[rank 0/1000] tcp set-up")
print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
net.reserve_descriptors(1000, "[rank 0/1000] tcp set-up")
print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _child(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_a_socket_that_cannot_be_made_names_the_limit_and_the_remedy():
    lines = dict(line.split(" | ", 1) for line in _child(_FILL).stdout.splitlines())
    assert set(lines) == {"connect", "listen"}, lines
    for what, message in lines.items():
        assert "out of file descriptors" in message, (what, message)
        assert "soft limit 128, hard limit 128" in message and "in use" in message, message
        assert "ulimit -n 128" in message, message
    assert "connect to rank 1 at 127.0.0.1:" in lines["connect"], lines["connect"]


def test_the_soft_limit_is_raised_to_the_hard_one_and_a_low_hard_limit_is_named():
    done = _child(_RESERVE)
    assert done.stdout.split() == ["soft", "4096", "soft", "256"], done.stdout
    assert "[rank 0/1000] tcp set-up: may need" in done.stderr, done.stderr
    assert "soft 256, hard 256" in done.stderr and "ulimit -n" in done.stderr, done.stderr
