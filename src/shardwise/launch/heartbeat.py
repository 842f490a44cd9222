"""A host that vanishes is named within a minute, whatever the collective timeout.

A collective may legitimately take minutes, so the collective timeout (30 minutes by default)
cannot double as failure detection: when one host of a job lost its link, every rank of every
host waited in gloo for the whole timeout, and then gloo named neither the host nor the op. So
when a world spans hosts, the first process of each host runs a heartbeat beside training:

- every ``interval`` seconds it increments its host's counter in the job's own store (the
  ``torch.distributed`` TCPStore at ``MASTER_ADDR:MASTER_PORT``, through a client connection of
  its own with a short timeout; nothing here opens a socket itself);
- it watches the other hosts' counters with its own clock (no clock is compared across hosts);
  a counter that has not moved for ``lost_after`` seconds, or a store it cannot reach for that
  long, means the host (or the host holding the store) is gone;
- it then prints what it knows first, on stderr: which host, its node rank and its ranks, and
  how long it has been silent, and ends its process with ``EXIT_LOST_HOST``; the launcher then
  stops this host's other workers and exits non-zero.

``lost_after`` is ``$SHARDWISE_HOST_TIMEOUT_S`` (default 60 s; ``0`` turns the heartbeat off).
The cost: one small store write and a read per other host every 5 s, on one process per host.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

TIMEOUT_VAR = "SHARDWISE_HOST_TIMEOUT_S"
DEFAULT_LOST_AFTER_S = 60.0
INTERVAL_S = 5.0
WATCH_S = 0.25  # how often the silence is measured: a lost host is named this late at most
EXIT_LOST_HOST = 70  # EX_SOFTWARE: distinct from a crash (1) and from preemption (75)
_PREFIX = "shardwise/heartbeat/"


def lost_after_s() -> float:
    """Seconds of silence after which a host counts as lost (0: the heartbeat is off)."""
    raw = os.environ.get(TIMEOUT_VAR, "")
    try:
        return float(raw) if raw else DEFAULT_LOST_AFTER_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds") from None


class Heartbeat(threading.Thread):
    """Beats for host ``node`` of ``nodes`` and watches the others (module docstring)."""

    def __init__(
        self,
        node: int,
        nodes: int,
        per_node: int,
        master: tuple[str, int],
        lost_after: float,
        interval: float = INTERVAL_S,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(name="shardwise-heartbeat", daemon=True)
        self.node, self.nodes, self.per_node = node, nodes, per_node
        self.master, self.lost_after, self.interval = master, lost_after, interval
        self.on_lost = on_lost or _exit_lost
        self.host = socket.gethostname()
        self.stop = threading.Event()
        self._io: threading.Thread | None = None

    def start(self) -> None:
        super().start()
        atexit.register(self.close)

    def close(self) -> None:
        """Stop beating and wait for the store call in flight. A daemon thread whose C++ store
        call returns while the interpreter finalizes is ended from inside that call, which
        aborts the whole process (SIGABRT, "terminate called without an active exception"):
        a rank that had finished training died that way on a loaded two-host run. So at exit
        the beat ends first, waiting at most the store's own timeout."""
        self.stop.set()
        if self._io is not None and self._io is not threading.current_thread():
            self._io.join(timeout=self._timeout().total_seconds() + 1.0)

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.interval, 1.0) * 2)

    def _store(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.master[0], self.master[1], is_master=False, timeout=self._timeout(),
            wait_for_workers=False,
        )  # fmt: skip

    def _ranks(self, node: int) -> str:
        return f"ranks {node * self.per_node}-{(node + 1) * self.per_node - 1}"

    def _beat(self) -> None:
        """The store side: beat, read the others' counters. A store call on a dead link can
        block far beyond its timeout, so this runs apart from ``run``, which only watches."""
        store, beat = None, 0
        while not self.stop.wait(self._pause(beat)):
            try:
                store = store or self._store()
                beat += 1
                store.set(f"{_PREFIX}{self.node}", f"{beat} {self.host}")
                self.reached = time.monotonic()
                for n in self.seen:
                    if store.check([f"{_PREFIX}{n}"]):
                        count, name = store.get(f"{_PREFIX}{n}").decode().split(" ", 1)
                        self.names[n] = f"host {name} (node {n})"
                        if int(count) != self.seen[n][0]:
                            # The beat landed after our previous read: count the silence from
                            # there, so a host is named within lost_after of its last beat, not
                            # up to one interval later (63-66 s for the default 60 s).
                            self.seen[n] = (int(count), self.read)
                self.read = time.monotonic()
            except (RuntimeError, OSError, ValueError):
                store = None  # reconnect next time; the silence is measured by run()

    def _pause(self, beat: int) -> float:
        """Until every other host has been heard once, poll fast: a host lost in the first
        seconds is then named by its host name, not only by its node rank."""
        if beat == 0:
            return 0.0
        named = all(name.startswith("host ") for name in self.names.values())
        return self.interval if named else min(0.5, self.interval)

    def run(self) -> None:
        self.reached = self.read = time.monotonic()
        self.seen = {n: (-1, self.reached) for n in range(self.nodes) if n != self.node}
        self.names = {n: f"node {n}" for n in self.seen}
        self._io = threading.Thread(target=self._beat, name="shardwise-heartbeat-io", daemon=True)
        self._io.start()
        while not self.stop.wait(min(self.interval, WATCH_S)):
            now = time.monotonic()
            if now - self.reached > self.lost_after:
                where = f"{self.master[0]}:{self.master[1]}"
                self.on_lost(
                    f"lost the job's store at {where} (host of node 0, {self._ranks(0)}): "
                    f"unreachable for {now - self.reached:.0f} s"
                )
                return
            for n, (_, last) in list(self.seen.items()):
                if now - last > self.lost_after:
                    self.on_lost(
                        f"lost {self.names[n]}, {self._ranks(n)}: no heartbeat for {now - last:.0f} s"
                    )
                    return


def _exit_lost(message: str) -> None:
    print(
        f"[shardwise] {message} (seen from host {socket.gethostname()}; "
        f"{TIMEOUT_VAR} sets the limit); stopping this host's workers",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_LOST_HOST)  # the training thread is blocked in a collective that never ends


def start_heartbeat(
    node: int, local_rank: int, world: int, per_node: int, master: tuple[str, int]
) -> Heartbeat | None:
    """Start the heartbeat on the first process of each host of a multi-host world."""
    lost_after = lost_after_s()
    if lost_after <= 0 or local_rank != 0 or per_node >= world or world % per_node:
        return None
    beat = Heartbeat(node, world // per_node, per_node, master, lost_after)
    beat.start()
    return beat
