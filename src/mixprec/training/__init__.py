"""The training loop and what runs beside it: train(), train_step() (the precision recipe) and
evaluate() (loop.py), each step's bookkeeping settled at once or a step late (ledger.py),
batch=auto's search (batch_size.py), stop signals and the divergence guard (safety.py), and
honest throughput (perf.py).

May import: every floor below (core, models, data, optim, parallel, internals, precision,
checkpoint, compile, sinks, diagnostics).
"""
