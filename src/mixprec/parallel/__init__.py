"""Parallel strategies, plugins like precisions: the interface and its loader (strategy.py),
parallel=ddp (ddp.py) and parallel=fsdp (fsdp.py, over sharding.py: FSDP2 per block and root
with its MixedPrecisionPolicy and full-state checkpoints); the process group and rank dealing
(distributed.py).

May import: core.
"""
