"""A run from its config to its summary: the root schema and validation (config.py), the one
builder (build.py) and the batch layout (layout.py), a run's life in its run dir (session.py:
main, run, Session), the one writer per run dir (rundir.py), what a refused run takes back
(footprint.py), summary.json's producer
(summary.py) and the messages a run prints (messages.py). session.py is the only reader of the
config, with build.py.

May import: every floor below.
"""
