"""A precision that owns its loss scaling: bf16 autocast, which torch's rule (a GradScaler for
float16 only) would leave unscaled, with a GradScaler of its own choosing through
Precision.make_scaler; and float64 inputs converted to float32 by convert_input, as every
precision's are. tests/test_seams.py trains with it."""

from mixprec.precision.base import Precision, PrecisionConfig, Scaler

Config = PrecisionConfig


class Plugin(Precision):
    @classmethod
    def make_scaler(cls, pcfg, scfg, device_type):
        return Scaler(
            device_type,
            init_scale=scfg.init_scale,
            growth_factor=scfg.growth_factor,
            backoff_factor=scfg.backoff_factor,
            growth_interval=scfg.growth_interval,
            enabled=True,
        )
