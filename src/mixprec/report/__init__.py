"""Reading finished run dirs: the comparison table and plots of a sweep (report.py, runs.py,
plots.py; `python -m mixprec.report`), the sweep's Hydra callback (sweep.py), and the
time-to-quality study (quality.py: the answer and its writer; seeds.py: its seeds, read from
the run dirs, and how many more it needs; coverage.py: what its intervals keep when seeds are
added until they are narrow; study_md.py: study.md's text; curves.py: the arithmetic;
study_cli.py: `python -m mixprec.study`'s flags).

May import: every floor below; it reads run dirs through sinks/local.py, never the run itself.
"""
