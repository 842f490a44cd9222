"""Tensor parallelism (Megatron-LM, arXiv 1909.08053): column/row layers (layers.py), vocabulary
parallel embedding and cross-entropy (vocab.py), their collectives as autograd functions
(comm.py), ``parallelize`` with its plans and the one table of style names (parallelize.py,
styles.py, fit.py, plans.py, hf_styles.py, heads.py), the RNG streams (random.py), activations
kept split over the group (partitioned_activations.py), where a slice sits in the whole tensor
(placement.py) and whole tensors gathered back (consolidate.py)."""
