"""Run by tests/test_sharding.py under torchrun (2 processes, gloo): an fp16 step whose
gradients overflow in rank 1's shard only (set inf there after the reduce-scatter, as an
overflow in the elements that rank holds), through mixprec's own shard() and train_step. Prints,
per rank, whether the step ran and the loss scale after it, as JSON in
$MIXPREC_TEST_FSDP_OVERFLOW_OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mixprec.parallel import sharding
from mixprec.precision import base as precision
from mixprec.training import loop

from conftest import group

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))
model.append(nn.Linear(32, 4))
prec = precision.build(group("precision", "amp"), group("scaler", "dynamic"), torch.device("cpu"))
model = sharding.shard(model, group("parallel", "fsdp"), prec, [model[1][0], model[1][1]])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
learner = loop.Learner(model, opt, sched, prec)


def overflow_in_rank_1s_shard(param) -> None:  # after the reduce-scatter: one shard's values
    if rank == 1:
        param.grad.to_local().fill_(float("inf"))


model[2].weight.register_post_accumulate_grad_hook(overflow_in_rank_1s_shard)
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
ran = [loop.train_step(learner, [(x, y)]).stepped for _ in range(2)]
out = Path(os.environ["MIXPREC_TEST_FSDP_OVERFLOW_OUT"]) / f"rank{rank}.json"
out.write_text(json.dumps({"rank": rank, "ran": ran, "scale": prec.loss_scale()}))
dist.destroy_process_group()
