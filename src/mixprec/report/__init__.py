"""Reading finished run dirs: the comparison table and plots of a sweep (report.py, runs.py,
plots.py; `python -m mixprec.report`), the sweep's Hydra callback (sweep.py), and the
time-to-quality study (study.py, its arithmetic in curves.py; `python -m mixprec.study`).

May import: every floor below; it reads run dirs through sinks/local.py, never the run itself.
"""
