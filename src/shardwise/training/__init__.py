"""The engine and its setup: ``initialize`` (initialize.py) builds the parts (parts.py) and the
``Engine`` (engine.py) that composes them; the batch loop (batch_loop.py) and the engine's
checkpoint calls (checkpoints/) work on those parts. Nothing outside this package imports the
engine class or writes into an engine."""
