"""``python -m shardwise run ...`` / ``python -m shardwise topo ...``: the same as ``shardwise``."""

from shardwise.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
