"""Mixture of experts with expert parallelism (docs/moe.md): gating.py (top-1/top-2 with
capacity), layer.py (``MoE``, ``MOELayer``, ``Experts``), comm.py (the all-to-all),
experts.py (groups from the mesh, state in the single-process vocabulary)."""
