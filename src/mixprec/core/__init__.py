"""The floor everything stands on (floor 0): what can stop a run and its exit code (errors.py),
the one atomic write and the disk checks (files.py), a plugin's own Config read from its node
(schema.py), `pkg.module:callable` targets of your own (targets.py), every metric key (metrics.py),
what a model learns from the data (tasks.py), the hardware profiles (hardware.py), the one place
that changes process-wide state (process.py), and what Hydra says about the launch (launch.py).

May import: internals (torch's private state is read there).
"""
