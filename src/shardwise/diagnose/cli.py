"""``shardwise diagnose RUN_DIR``: the merged hang report, from the records the ranks wrote.

    shardwise diagnose runs/exp1                 (its diagnose/ folder)
    shardwise diagnose ./shardwise-diagnose      (the default folder, or any folder of rank<N>.json)

The same report rank 0 prints when it can (diagnose/report.py). Gather the folders of several
nodes into one first when the run directory is not on a shared filesystem.
"""

from __future__ import annotations

import argparse

from shardwise.diagnose import report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose", help="the merged report of a hang from the ranks' records (rank<N>.json)"
    )
    p.add_argument("run_dir", help="run directory (with diagnose/) or the folder of the records")


def run(args: argparse.Namespace) -> str:
    """The text the command prints (no records: ValueError naming the folders tried)."""
    directory, records = report.load(args.run_dir)
    world = max(d.get("world_size", 0) for d in records.values())
    return report.format_report(records, world, str(directory))
