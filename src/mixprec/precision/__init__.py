"""Precisions as plugins (base.py: the interface, and fp32, tf32, amp, amp_accum and bf16),
fp8 through torchao (fp8.py; fp8_auto's per-layer plan: fp8_layers.py, timed by fp8_timing.py's
child processes), layers kept in fp32 by name (fp32_layers.py), and the guards
around a step: was it skipped, do BatchNorm statistics survive an overflow (step_guards.py).

May import: core, models (a precision converts a model).
"""
