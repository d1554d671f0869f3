"""Why a precision fails or where it computes: the precision doctor that re-runs an overflowing
step with hooks and names the layer (doctor.py), and the dtype audit with tensor-core alignment
(audit.py; `python -m mixprec.diagnose` is its command line).

May import: core, models, precision, parallel.
"""
