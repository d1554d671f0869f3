"""Checkpoints: find, write, load and check them (store.py: last.pt, the newest whole one, the
errors that name the file), sharded ones through torch.distributed.checkpoint (dcp.py), and the
RNG state of every rank (rng.py).

May import: core, models, parallel.
"""
