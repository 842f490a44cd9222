"""DeepSpeed's hostfile and ``--include`` / ``--exclude`` resource filters.

A hostfile names each node and its slots (devices)::

    worker-0 slots=4
    worker-1 slots=4   # comments and blank lines are ignored

A filter is ``NODE_SPEC[@NODE_SPEC...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT...]]``:
``--include worker-1:0,3`` keeps two slots of one node; ``--exclude worker-0`` drops a node.
Pure functions: no ssh, no process is started here (each node runs ``shardwise run`` itself).
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")

Resources = dict[str, list[int]]  # host -> sorted slot indices, in hostfile order


def parse_hostfile(text: str) -> dict[str, int]:
    """``host slots=N`` lines -> ``{host: N}``; ``#`` comments and blank lines are skipped.

    A malformed line, a host listed twice or a file without hosts raises ``ValueError``.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(
                f"Hostfile contains a bad entry on line {number}: {raw.strip()!r} "
                "(expected 'HOSTNAME slots=N')"
            )
        host, slots = m.group(1), int(m.group(2))
        if host in hosts:
            raise ValueError(f"Hostfile contains multiple entries for {host} (line {number})")
        hosts[host] = slots
    if not hosts:
        raise ValueError("Hostfile is empty or not formatted correctly: no 'HOSTNAME slots=N' line")
    return hosts


def _parse_spec(spec: str, hosts: Resources) -> tuple[str, list[int] | None]:
    """``name`` -> (name, None: every slot); ``name:0,2`` -> (name, [0, 2]); checked against hosts."""
    name, sep, slots_text = spec.partition(":")
    if not name or ":" in slots_text or (sep and not slots_text):
        raise ValueError(f"bad node spec {spec!r}: expected NAME or NAME:SLOT[,SLOT...]")
    if name not in hosts:
        raise ValueError(f"host {name!r} (in {spec!r}) is not in the hostfile: {sorted(hosts)}")
    if not sep:
        return name, None
    try:
        slots = sorted({int(s) for s in slots_text.split(",")})
    except ValueError:
        raise ValueError(f"bad node spec {spec!r}: slots must be integers") from None
    missing = [s for s in slots if s not in hosts[name]]
    if missing:
        raise ValueError(
            f"slot(s) {missing} of {spec!r} do not exist on {name}: it has {hosts[name]}"
        )
    return name, slots


def parse_resource_filter(hosts: Resources, include: str = "", exclude: str = "") -> Resources:
    """Keep (``include``) or drop (``exclude``) nodes and slots; the two are mutually exclusive.

    Returns ``{host: sorted slots}`` in hostfile order; hosts left without slots disappear.
    """
    if include and exclude:
        raise ValueError("--include and --exclude are mutually exclusive: give one of them")
    if not include and not exclude:
        return {h: sorted(s) for h, s in hosts.items()}
    chosen: dict[str, set[int]] = {} if include else {h: set(s) for h, s in hosts.items()}
    for spec in (include or exclude).split("@"):
        name, slots = _parse_spec(spec.strip(), hosts)
        every = set(hosts[name]) if slots is None else set(slots)
        if include:
            chosen.setdefault(name, set()).update(every)
        else:
            chosen[name] -= every
    return {h: sorted(chosen[h]) for h in hosts if chosen.get(h)}
