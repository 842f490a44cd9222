"""The launcher asks DNS for this machine's name once, not once per event.

torchrun's elastic agent stamps every event it records (worker group start, each worker, each
state change) with ``socket.getfqdn(socket.gethostname())``, a reverse lookup each time: seven
per two-worker launch, and more with every restart. Where the host name is not in /etc/hosts
and DNS is slow to answer, each waits for the resolver's timeout: with a 2 s timeout simulated,
a two-worker launch took 21 s instead of 3 s. The name cannot change while the agent runs, so
``shardwise run`` memoizes torch's helper for its own process (torch's agent and rendezvous are
used as they are; only the repeated lookup goes). On one node the name only labels those
events, so the host name itself is used and DNS is not asked at all (21 s -> 6 s above; the
rest is the store's own lookups in each worker).
"""

from __future__ import annotations

import functools
import socket

from torch.distributed.elastic.agent.server import api as agent_api

_HELPER = "_get_fq_hostname"


def resolve_hostname_once(one_node: bool) -> bool:
    """Memoize the agent's host-name lookup in this process (on one node: the host name, no
    lookup); False if this torch has no such helper."""
    helper = getattr(agent_api, _HELPER, None)
    if helper is None or hasattr(helper, "cache_info"):
        return helper is not None
    setattr(agent_api, _HELPER, functools.cache(socket.gethostname if one_node else helper))
    return True
