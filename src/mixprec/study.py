"""`python -m mixprec.study SWEEP_DIR`: the time-to-quality study of a sweep (report/study.py)."""

from mixprec.report.study import main

if __name__ == "__main__":
    main()
