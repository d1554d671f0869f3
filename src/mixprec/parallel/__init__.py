"""Parallel strategies: the process group, DDP and rank dealing (distributed.py), and
parallel=fsdp, FSDP2 per block and root with its MixedPrecisionPolicy and full-state checkpoints
(sharding.py).

May import: core.
"""
