"""precision.fp8_weight_cast=shared: one float8 copy of each weight serves the forward and the
backward matmul that reads it.

torchao's Float8Linear casts its weight inside its matmul function
(`matmul_with_hp_or_float8_args`): the forward casts it (amax over the whole weight, scale,
cast), and the backward casts the same weight again for the grad-input GEMM. With tensorwise
scaling both casts are the same arithmetic (one amax, one scale,
`cast_config_weight_for_grad_input == cast_config_weight`), so the second is a repeat: a read of
every fp32 weight for its amax and another for its cast. Whether inductor removes it is its
partitioner's choice, which differs between torch versions (traced in tests/test_fp8_shared.py:
torch 2.14 re-casts a weight in the backward, torch 2.11 keeps them all). Here the cast happens
in the layer's forward, outside the matmul function; the function then sees a float8 weight
(`tensor_already_casted_to_fp8`), uses it in the forward, saves it, and multiplies the
backward's gradient with it. The gradient reaches the fp32 weight through torchao's cast, whose
backward passes it through, as for FSDP2's float8 all-gather, which hands torchao a float8
weight the same way.

The result is the same numbers (the same scale and cast: the test compares them bit for bit);
what changes is the work and the memory: one weight cast per forward instead of up to two, and
each float8 weight (1 byte a parameter) kept from the forward to the backward.

Only for tensorwise layers of an unsharded model: rowwise scales the weight along another axis
for the backward (a different cast, nothing to share), and with parallel=fsdp the gathered
weight is freed after the forward, which keeping a float8 copy would undo (FSDP2's float8
all-gather, precision.fp8_all_gather, already hands torchao a float8 weight).

Written against torchao 0.18's Float8Linear (a class torchao calls internal); other versions
keep torchao's own forward (SUPPORTED), and `precision.fp8_weight_cast=per_matmul` switches it
off anywhere.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)
SUPPORTED = ("0.18.",)  # torchao releases whose Float8Linear.forward this one mirrors
CHOICES = ("shared", "per_matmul")


def _cast_once_forward(self, input: torch.Tensor) -> torch.Tensor:
    """Float8Linear.forward (torchao 0.18) with the weight cast before the matmul function."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    if torch.is_autocast_enabled():  # as torchao's: the output in autocast's dtype
        input = input.to(torch.get_autocast_gpu_dtype())
    weight = self.weight
    if not tensor_already_casted_to_fp8(weight):
        weight = hp_tensor_to_float8_dynamic(
            weight,
            self.config.cast_config_weight.target_dtype,
            self.linear_mm_config,
            gemm_input_role=GemmInputRole.WEIGHT,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )
    output = matmul_with_hp_or_float8_args.apply(
        input, weight.t(), self.linear_mm_config, self.config
    )
    if self.bias is not None:
        output = output + self.bias.to(output.dtype)
    return output


def shareable(module: nn.Module) -> bool:
    """A Float8Linear whose forward and grad-input casts of the weight are one cast: dynamic
    tensorwise scaling for both."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if type(module) is not Float8Linear:
        return False
    c = module.config
    w, w_gi = c.cast_config_weight, c.cast_config_weight_for_grad_input
    return (
        w == w_gi
        and w.scaling_type is ScalingType.DYNAMIC
        and w.scaling_granularity is ScalingGranularity.TENSORWISE
    )


_CLASSES: dict[type, type] = {}


def _subclass(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(
            "SharedCast" + base.__name__, (base,), {"forward": _cast_once_forward}
        )
    return _CLASSES[base]


def supported() -> bool:
    import torchao

    return torchao.__version__.startswith(SUPPORTED)


def share(model: nn.Module) -> list[str]:
    """Give each shareable Float8Linear of `model` the shared weight cast (in place); returns
    their names. Another torchao than SUPPORTED: none, with one line saying why."""
    if not supported():
        import torchao

        log.warning(
            "precision.fp8_weight_cast=shared: written for torchao %s, this is %s; its own "
            "Float8Linear forward is kept (each matmul casts the weight)",
            "/".join(v + "x" for v in SUPPORTED),
            torchao.__version__,
        )
        return []
    names = []
    for name, module in model.named_modules():
        if shareable(module):
            module.__class__ = _subclass(type(module))
            names.append(name)
    return names
