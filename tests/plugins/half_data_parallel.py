"""A strategy whose ranks are not all data-parallel (as tensor parallel's would be): it calls
this process rank 1 of 2 data-parallel ranks, whatever the world. tests/test_seams.py checks
that the effective batch and the samples each rank is dealt follow it, not the world."""

from mixprec.parallel import ddp

Config = ddp.Config


class Strategy(ddp.Strategy):
    def data_parallel(self, dd):
        return 1, 2
