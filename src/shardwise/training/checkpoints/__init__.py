"""The engine's checkpoint calls (save.py, load.py), what a rank holds (held.py), the config's
periodic saves, resume and SIGTERM save (autosave.py) and the periodic replica check
(replica_watch.py). The file format itself is ``shardwise.checkpoint``, which knows no engine."""
