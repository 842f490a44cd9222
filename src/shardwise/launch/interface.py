"""Which network interface gloo uses: loopback on one host, the one that reaches the master on
several; chosen before the first group, never over the user's ``GLOO_SOCKET_IFNAME``.

**One host.**
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

**Several hosts.** gloo binds to the address the host name resolves to. Debian's default hosts
file maps the host name to ``127.0.1.1``, so gloo listened on loopback and the other host's
connections were refused (``Connection refused ... remote=[127.0.0.1]``) unless the user set
``GLOO_SOCKET_IFNAME``. When the host name resolves to a loopback address, shardwise asks the
kernel which local address reaches the master (``ip route get``: its ``src``), names the
interface that holds that address, and says so on stderr; without iproute2 it warns instead.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
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


def _ip(*args: str) -> str:
    """The output of iproute2's ``ip`` (empty if it is missing or fails)."""
    tool = shutil.which("ip")
    if tool is None:
        return ""
    out = subprocess.run([tool, *args], capture_output=True, text=True, timeout=10)
    return out.stdout if out.returncode == 0 else ""


def interface_towards(addr: str) -> str | None:
    """The interface holding the local address the kernel uses to reach ``addr`` (the master
    itself when ``addr`` is local), or None if iproute2 cannot tell."""
    try:
        addr = socket.gethostbyname(addr)
    except OSError:
        return None
    src = re.search(r"\bsrc (\S+)", _ip("route", "get", addr))
    if src is None:
        return None
    for line in _ip("-o", "addr", "show").splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == src.group(1):
            return fields[1].rstrip(":").split("@")[0]
    return None


def host_name_is_loopback() -> bool:
    """Whether this machine's host name resolves to a loopback address (Debian's 127.0.1.1)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
    except (OSError, ValueError):
        return False


def choose_gloo_interface(
    backend: str,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    environ: MutableMapping[str, str] = os.environ,
) -> str | None:
    """Loopback for a world on this host (``pin_gloo_to_loopback``); on several hosts, when the
    host name resolves to loopback, the interface that reaches ``master_addr``. The name set,
    or None when gloo keeps its own choice."""
    pinned = pin_gloo_to_loopback(backend, world_size, local_world_size, master_addr, environ)
    if pinned is not None or backend != "gloo":
        return pinned
    if world_is_on_this_host(world_size, local_world_size, master_addr, environ):
        return None
    if environ.get(IFNAME_VAR):
        _warn_if_loopback(environ[IFNAME_VAR], master_addr)
        return None
    if not host_name_is_loopback():
        return None
    name = interface_towards(master_addr)
    host = socket.gethostname()
    if name is None:
        print(
            f"[shardwise] warning: host name {host} resolves to a loopback address, so gloo "
            f"would listen where other hosts cannot reach it; set {IFNAME_VAR} to the "
            f"interface that reaches {master_addr}",
            file=sys.stderr,
        )
        return None
    environ[IFNAME_VAR] = name
    print(
        f"[shardwise] host name {host} resolves to loopback: gloo uses {name}, the interface "
        f"that reaches the master {master_addr} ({IFNAME_VAR}={name})",
        file=sys.stderr,
    )
    return name


def _warn_if_loopback(name: str, master_addr: str) -> None:
    """A loopback ``GLOO_SOCKET_IFNAME`` on a world that spans hosts cannot connect (the other
    hosts are refused at 127.0.0.1); it is often inherited from a one-host shell or job."""
    if name in LOOPBACK_NAMES:
        print(
            f"[shardwise] warning: {IFNAME_VAR}={name} is the loopback interface but the world "
            f"spans hosts: other hosts cannot reach it; unset {IFNAME_VAR} or name the "
            f"interface that reaches the master {master_addr}",
            file=sys.stderr,
        )
