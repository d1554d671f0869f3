"""`python -m mixprec.report SWEEP_DIR`: the comparison table and plots of a sweep (report.py)."""

from mixprec.report.report import main

main()
