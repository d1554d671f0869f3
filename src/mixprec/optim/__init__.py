"""Optimizers and learning-rate schedules (optimizers.py: which keys each reads, the LR scaling
rule), and optimizer.state / optimizer.offload: torchao's 8-bit, 4-bit and fp8 moments and the CPU
offload (states.py).

May import: core.
"""
