"""Two real hosts on this machine: Linux network namespaces joined by a veth pair.

``two_hosts`` (session fixture) makes namespaces ``sw-host0`` and ``sw-host1`` with the
addresses 10.77.0.1 and 10.77.0.2 on a veth pair, loopback up in each, and deletes them at the
end (also on failure). Each host's commands run in its namespace with a host name of its own
(``host0``/``host1``, a UTS namespace) and a hosts file of its own (a mount namespace binds it
over /etc/hosts), so the two see each other only through the veth link, as two machines would.
It needs root and iproute2; without them the tests skip saying which is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Named per test run (pid), so two runs on one machine never delete each other's hosts.
_RUN = os.getpid() % 100000
NAMESPACES = (f"sw-h0-{_RUN}", f"sw-h1-{_RUN}")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
LINKS = (f"sw-v0-{_RUN}", f"sw-v1-{_RUN}")
# Variables that describe one host's world and must not leak from the test process.
HOST_LOCAL_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GLOO_SOCKET_IFNAME")  # fmt: skip
# Two ways a host may name itself: by its own address, or Debian's default (127.0.1.1).
HOSTS_FILES = {
    "own address": "127.0.0.1 localhost\n{addr} {name}\n10.77.0.1 host0\n10.77.0.2 host1\n",
    "debian 127.0.1.1": "127.0.0.1 localhost\n127.0.1.1 {name}\n",
}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def delete_namespaces(namespaces: tuple[str, ...] = NAMESPACES) -> None:
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)  # the veth ends go with their namespaces


def kill_in(namespaces: tuple[str, ...]) -> None:
    """SIGKILL every process in the namespaces: torch's launcher starts its workers in sessions
    of their own and slurmstepd detaches, so killing a process group leaves them running."""
    for ns in namespaces:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def veth_pair(
    namespaces: tuple[str, ...], links: tuple[str, ...], addresses: tuple[str, ...]
) -> None:
    """Two namespaces joined by a veth pair, an address (/24) on each end, loopback up."""
    for ns in namespaces:
        _ip("netns", "add", ns)
    _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
    for ns, link, addr in zip(namespaces, links, addresses, strict=True):
        _ip("link", "set", link, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
        _ip("-n", ns, "link", "set", link, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def set_link(i: int, up: bool) -> None:
    """Take host ``i``'s end of the link down (a cable pulled) or bring it back up."""
    _ip("-n", NAMESPACES[i], "link", "set", LINKS[i], "up" if up else "down")


@dataclass
class Hosts:
    """The two hosts: run ``argv`` on host ``i`` with its name and a hosts-file flavour."""

    tmp: Path

    @staticmethod
    def environment(**extra: str) -> dict[str, str]:
        """This process's environment without what belongs to one host's world: a rank set by
        a launcher, a master address, and a gloo interface pinned to loopback by an earlier
        one-host test in this pytest process (both hosts then listened on loopback)."""
        env = {k: v for k, v in os.environ.items() if k not in HOST_LOCAL_VARS}
        env.update(OMP_NUM_THREADS="1", **extra)
        return env

    @staticmethod
    def kill_all(hosts: tuple[int, ...] = (0, 1)) -> None:
        """SIGKILL every process on the hosts (both by default)."""
        kill_in(tuple(NAMESPACES[i] for i in hosts))

    def command(self, i: int, argv: list[str], hosts: str = "own address") -> list[str]:
        name = f"host{i}"
        path = self.tmp / f"hosts-{i}-{hosts.replace(' ', '-')}"
        path.write_text(HOSTS_FILES[hosts].format(addr=ADDRESSES[i], name=name))
        script = f'hostname {name} && mount --bind {path} /etc/hosts && exec "$@"'
        return ["ip", "netns", "exec", NAMESPACES[i], "unshare", "--uts", "--mount", "--",
                "sh", "-c", script, "sh", *argv]  # fmt: skip


@pytest.fixture(scope="session")
def two_hosts(tmp_path_factory) -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("two-host tests need root to create network namespaces")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"two-host tests need {tool} (Debian's iproute2 / util-linux)")
    delete_namespaces()
    try:
        veth_pair(NAMESPACES, LINKS, ADDRESSES)
        yield Hosts(tmp_path_factory.mktemp("hosts"))
    finally:
        delete_namespaces()
