"""Handing a file descriptor to other processes of one machine: how a
multicast object's POSIX handle (msc.cuda.multicast) reaches the group's
other members.

A file descriptor means nothing outside its process; the kernel copies one
into another process when it travels as SCM_RIGHTS ancillary data over a
unix socket. NCCL does the same for its cuMem handles (src/os/linux_ipcsocket.cc:
AF_UNIX, an abstract socket name by default, SCM_RIGHTS), as does MSCCL++
(src/core/unix_socket.cc). The other way, pidfd_getfd(2), needs ptrace
permission over the exporter (PTRACE_MODE_ATTACH_REALCREDS), which Yama's
default ptrace_scope of 1 denies between sibling processes such as
torchrun's workers, so it is not used.

The exporter listens on an abstract socket (a name in the network
namespace, no file to clean up), publishes its name through the bootstrap's
gather, accepts one connection per expected peer and sends each the
descriptor. It hands it only to a peer process the group published: the
socket's peer credentials (SO_PEERCRED) must name one of those pids, run by
this user; any other connection is dropped. Both ends give up after a
deadline with an error naming what did not come.
"""
from __future__ import annotations

import os
import socket
import struct
import time
import uuid
from collections import Counter

from msc.errors import UsageError

_MESSAGE = b"msc-fd"


class FdServer:
    """Offers one descriptor to a known set of peer processes."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.name = f"\0msc-fd-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        try:
            self.sock.bind(self.name)
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise

    @property
    def address(self) -> str:
        """The socket's name as peers pass it to ``receive_fd`` (abstract: '@' for the leading NUL)."""
        return "@" + self.name[1:]

    def send(self, fd: int, pids, timeout_s: float) -> None:
        """Send ``fd`` to each process in ``pids`` (a process listed k times: k times, as it
        hosts k members) that connects before the deadline."""
        waiting, deadline = Counter(pids), time.monotonic() + timeout_s
        while +waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UsageError(f"process(es) {', '.join(map(str, sorted(+waiting)))} never came for the "
                                 f"multicast handle offered at {self.address} within {timeout_s:g} s")
            self.sock.settimeout(left)
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            with conn:
                pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
                if waiting[pid] < 1 or uid != os.getuid():
                    continue                  # not a member this group published: it gets nothing
                socket.send_fds(conn, [_MESSAGE], [fd])
                waiting[pid] -= 1

    def close(self) -> None:
        self.sock.close()


def receive_fd(address: str, timeout_s: float) -> int:
    """The descriptor the FdServer at ``address`` sends (a new descriptor of this process)."""
    if not address.startswith("@"):
        raise UsageError(f"a multicast handle's address is an abstract socket name ('@...'), got {address!r}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + address[1:])
            message, fds, _, _ = socket.recv_fds(sock, len(_MESSAGE), 1)
        except (socket.timeout, OSError) as exc:
            raise UsageError(f"could not receive the multicast handle from {address} within {timeout_s:g} s: "
                             f"{exc.strerror or exc}") from None
    if message != _MESSAGE or len(fds) != 1:
        for extra in fds:
            os.close(extra)
        raise UsageError(f"{address} sent {message!r} with {len(fds)} descriptor(s), not one multicast handle")
    return fds[0]
