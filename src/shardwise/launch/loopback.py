"""Gloo on one host talks over the loopback interface, without asking DNS.

Every gloo process group (the world and each ``new_group``: a data x tensor mesh makes about
ten) creates its own transport device. Unless ``GLOO_SOCKET_IFNAME`` names an interface, gloo
finds its address by resolving the machine's host name, twice per group (seen with strace).
Where the host name is not in ``/etc/hosts`` each lookup goes to DNS, and on a closed network
a lookup waits for the resolver's timeout: a DP2 x TP2 engine that starts in half a second
took over two minutes on such a machine. When every rank of the world is on this host, the
loopback interface is the address gloo would fall back to anyway, so shardwise names it
before the first group is made. A user's own ``GLOO_SOCKET_IFNAME`` always wins, and worlds
that span hosts are left alone (they need a real interface).

"Every rank is on this host" is only assumed when something says so: one process, a master
address on the loopback (no other host could reach it), or a launcher that stated the local
world size (torchrun's ``LOCAL_WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE``, Slurm's tasks per
node) equal to the world size. A hand-set ``RANK``/``WORLD_SIZE`` on two hosts, where the local
size is only a default, keeps gloo's own choice.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping

IFNAME_VAR = "GLOO_SOCKET_IFNAME"
LOOPBACK_NAMES = ("lo", "lo0")  # Linux, macOS/BSD
LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)


def is_loopback_address(addr: str) -> bool:
    """True for ``localhost`` and 127.0.0.0/8 or ``::1`` literals (no lookup is made)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def world_is_on_this_host(
    world_size: int, local_world_size: int, master_addr: str, environ: Mapping[str, str]
) -> bool:
    """Whether the environment says every rank runs here (see the module docstring)."""
    if world_size == 1 or is_loopback_address(master_addr):
        return True
    stated = any(environ.get(name) for name in LOCAL_SIZE_VARS)
    return stated and local_world_size == world_size


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface, or None if it has none we know."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in LOOPBACK_NAMES if n in names), None)


def pin_gloo_to_loopback(
    backend: str,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    environ: MutableMapping[str, str] = os.environ,
) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the loopback interface for a gloo world whose ranks are
    all on this host; return the name set, or None when nothing was changed (another backend,
    a world that is or may be on several hosts, a name the user gave)."""
    if backend != "gloo" or environ.get(IFNAME_VAR):
        return None
    if not world_is_on_this_host(world_size, local_world_size, master_addr, environ):
        return None
    name = loopback_interface()
    if name is not None:
        environ[IFNAME_VAR] = name
    return name
