"""Optimizer state in low precision or on the CPU, through torchao's optimizers.

AdamW keeps two fp32 moments per parameter: 8 bytes, twice the weights. `optimizer.state`
stores them in 8 bits, 4 bits (block-wise quantised, as bitsandbytes does) or fp8 (torchao's
AdamW8bit / AdamW4bit / AdamWFp8; the weights and the update stay fp32); or `bf16`: the weights
themselves and both moments in bf16, with no fp32 master copy, each update stochastically
rounded into the bf16 weights (torchao's `_AdamW(bf16_stochastic_round=True)`, the recipe its
docs give), so that updates smaller than a bf16 step still move the weights on average.
`optimizer.offload=cpu` keeps the state, and runs the step, in host memory (torchao's
CPUOffloadOptimizer: each gradient is copied to pinned host memory as the backward produces it,
the CPU steps, the new weights are copied back). All keep timm's parameter groups (no weight
decay on biases and norms) and compose with the precisions they can take; what they cannot do
is refused before training.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from timm.optim import param_groups_weight_decay

from mixprec.core import norms
from mixprec.core.errors import ConfigError, one_of

log = logging.getLogger(__name__)

STATES = ("fp32", "bf16", "8bit", "4bit", "fp8")
OFFLOADS = ("none", "cpu")
_TORCHAO = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8", "bf16": "_AdamW"}


def check_config(ocfg) -> None:
    """What the config alone decides (OptimizerConfig.__post_init__)."""
    one_of("optimizer.state", ocfg.state, STATES)
    one_of("optimizer.offload", ocfg.offload, OFFLOADS)
    if ocfg.state != "fp32" and ocfg.name != "adamw":
        raise ConfigError(
            f"optimizer.state={ocfg.state} needs optimizer=adamw (torchao's low-bit optimizers "
            f"are Adam-type); optimizer={ocfg.name} keeps optimizer.state=fp32"
        )
    if used(ocfg) and (ocfg.fused or ocfg.foreach is not None):
        key = "fused" if ocfg.fused else "foreach"
        raise ConfigError(
            f"optimizer.{key}={getattr(ocfg, key)} cannot be used with optimizer.state="
            f"{ocfg.state} optimizer.offload={ocfg.offload} (torchao's optimizers choose their "
            f"own kernels); leave optimizer.{key}=null"
        )


def bytes_per_param(ocfg) -> int:
    """What each trainable parameter costs on the device before any activation: its weight and
    gradient (fp32; bf16 with optimizer.state=bf16) and the optimizer's state (Adam's two
    moments at the state's width; SGD's momentum; none on the device when offloaded)."""
    if ocfg.name == "sgd":
        return 8 + (4 if ocfg.momentum else 0)
    moments = {"fp32": 8, "bf16": 4, "8bit": 2, "4bit": 1, "fp8": 2}.get(ocfg.state, 8)
    weights = 4 if ocfg.state == "bf16" else 8  # weight + gradient
    return weights + (0 if ocfg.offload != "none" else moments)


def used(ocfg) -> bool:
    return ocfg.state != "fp32" or ocfg.offload != "none"


def check_run(ocfg, prec, device: torch.device, world: int, clipping: bool) -> None:
    """What needs the run: bf16 weights need bf16 autocast; offload moves gradients to the host
    inside the backward, so it needs a GPU, one process, and no step between the backward and
    the optimizer's step."""
    if used(ocfg):
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"optimizer.state={ocfg.state} optimizer.offload={ocfg.offload} needs torchao: "
                "pip install -e '.[fp8]' (make installs it)"
            ) from None
    if ocfg.state == "bf16" and (prec.dtype is not torch.bfloat16 or prec.owned()):
        raise ConfigError(
            f"optimizer.state=bf16 keeps the weights themselves in bf16 (no fp32 copy): it "
            f"needs precision=bf16 (this run has precision={prec.name})"
        )
    if ocfg.offload != "cpu":
        return
    why = None
    if ocfg.state == "bf16":
        why = "optimizer.state=bf16 is not offloaded (its weights are bf16 on the GPU already)"
    elif device.type != "cuda":
        why = "this run has no GPU (it moves optimizer state from GPU memory to host memory)"
    elif world > 1:
        why = f"it runs in one process only (torchao's CPUOffloadOptimizer); world is {world}"
    elif prec.scaling:
        why = (
            "a GradScaler (precision=amp) must unscale and check the gradients before the "
            "step, and offload copies them to the host during the backward; use precision=bf16"
        )
    elif clipping:
        why = (
            "trainer.clip_grad_norm clips the GPU gradients after the backward, and offload "
            "has already copied them to the host; set trainer.clip_grad_norm=null"
        )
    if why:
        raise ConfigError(f"optimizer.offload=cpu cannot run here: {why}")


def build(ocfg, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """torchao's optimizer for optimizer.state / optimizer.offload, on timm's groups."""
    import torchao.optim

    groups = param_groups_weight_decay(
        model, ocfg.weight_decay, no_weight_decay_list=_no_decay(model)
    )  # as timm's create_optimizer_v2 makes them: no decay on biases, norms, model's own list
    if ocfg.name == "adamw":
        kwargs = dict(lr=lr, betas=tuple(ocfg.betas), eps=ocfg.eps)
        if ocfg.state == "bf16":
            kwargs.update(bf16_stochastic_round=True)
        cls = getattr(torchao.optim, _TORCHAO[ocfg.state]) if ocfg.state != "fp32" else None
    else:
        kwargs = dict(lr=lr, momentum=ocfg.momentum, nesterov=ocfg.nesterov)
        cls = None
    if ocfg.offload == "cpu":
        base = cls or {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[ocfg.name]
        optimizer = _offload_optimizer()(groups, base, **kwargs)
    else:
        optimizer = cls(groups, **kwargs)
    log.info(
        "optimizer=%s: state %s%s (torchao %s)",
        ocfg.name,
        ocfg.state,
        ", stepped on the CPU from host memory" if ocfg.offload == "cpu" else " on the device",
        type(optimizer).__name__,
    )
    return optimizer


def to_weights(ocfg, model: torch.nn.Module) -> None:
    """optimizer.state=bf16: the weights in bf16, and BatchNorm's statistics with them (its
    kernels take one dtype); other buffers (a Llama's rotary tables) stay as they are."""
    if ocfg.state == "bf16":
        for m in model.modules():
            if isinstance(m, norms.BATCH_NORMS):
                m.to(torch.bfloat16)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        log.info("optimizer.state=bf16: the weights are bf16 (no fp32 master copy)")


def _offload_optimizer() -> type:
    """torchao's CPUOffloadOptimizer with torch's step hooks, which the loop uses to learn that
    a step ran and to read memory around it (it skips Optimizer.__init__, which sets them up)."""
    from torchao.optim import CPUOffloadOptimizer

    class Offload(CPUOffloadOptimizer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._optimizer_step_pre_hooks: dict = OrderedDict()
            self._optimizer_step_post_hooks: dict = OrderedDict()

        def load_state_dict(self, state_dict) -> None:
            """The moments, and the host's copy of the weights from the device's: a resume
            loads the model's weights after this optimizer copied the fresh ones to the host.
            And the small tensors' groups: torch's load_state_dict gives the on-device optimizer
            new group dicts, while param_groups (what the LR schedule sets) still listed the old
            ones, so those tensors kept the checkpoint's lr after a resume."""
            super().load_state_dict(state_dict)
            for p_device, p_host in self.param_d2h_map.items():
                p_host.copy_(p_device.detach())
            if self.d_opt is not None:
                self.d_param_groups = self.d_opt.param_groups

        def step(self, closure=None):
            for hook in list(self._optimizer_step_pre_hooks.values()):
                hook(self, (), {})
            loss = super().step(closure)
            for hook in list(self._optimizer_step_post_hooks.values()):
                hook(self, (), {})
            return loss

    return Offload


def _no_decay(model: torch.nn.Module) -> set:
    hook = getattr(model, "no_weight_decay", None)
    return set(hook()) if callable(hook) else set()
