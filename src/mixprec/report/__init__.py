"""Reading finished run dirs: the comparison table and plots of a sweep (report.py, runs.py,
plots.py; `python -m mixprec.report`), the sweep's Hydra callback (sweep.py), and the
time-to-quality study (study.py: the answer; seeds.py: its seeds, read from the run dirs, and
how many more it needs; study_md.py: study.md's text; curves.py: the arithmetic;
`python -m mixprec.study`).

May import: every floor below; it reads run dirs through sinks/local.py, never the run itself.
"""
