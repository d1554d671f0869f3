"""Why a precision fails or where it computes: the precision doctor that re-runs an overflowing
step with hooks and names the layer (doctor.py), the dtype audit with tensor-core alignment
(audit.py; `python -m mixprec.diagnose` is its command line), per-layer cast numerics
(numerics.py), the dtype plan read from the live objects (dtype_plan.py), the peak's parts
(memory.py), and the eager re-run that leaves a run untouched, which they share (replay.py).

May import: core, models, precision, parallel, sinks (reading a run dir's files).
"""
