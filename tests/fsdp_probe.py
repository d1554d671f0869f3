"""Run by tests/test_sharding.py under torchrun (2 processes, gloo): batch=auto's probes under
parallel=fsdp, made by mixprec's own build.probes on both ranks at once. Then rank 1 alone
trains two probe steps while rank 0 waits in a barrier, as it would after running out of
memory: the barrier ends only if the probe ran no collective over both ranks. Writes, per rank,
what the probe's model is and holds as JSON in $MIXPREC_TEST_FSDP_PROBE_OUT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mixprec import data as datasets
from mixprec.parallel import distributed, sharding
from mixprec.run import build
from mixprec.run.config import validate
from mixprec.training import loop

from conftest import LM_CPU, compose_cfg

dist.init_process_group("gloo")
rank = dist.get_rank()
c = validate(compose_cfg([*LM_CPU, "parallel=fsdp", "batch=4"]))
new_learner, inputs = build.probes(c, torch.device("cpu"))
row: dict = {"rank": rank}
if rank == 1:
    learner = new_learner(4)
    x, y = inputs(4)
    stepped = [loop.train_step(learner, [(x, y)], 1.0).stepped for _ in range(2)]
    weights = list(learner.model.parameters())
    row.update(
        stepped=stepped,
        sharded=sharding.is_sharded(learner.model),
        mesh_sizes=sorted({w.device_mesh.size() for w in weights}),
        holds_all=all(sharding.local(w).numel() == w.numel() for w in weights),
    )
dist.barrier()
num_classes, shape = datasets.spec(c.data)
spec = build.Spec(num_classes, shape, 4, datasets.task(c.data))
world = distributed.Dist(rank, rank, 2, grouped=True)  # training's own build: a share each
cpu = torch.device("cpu")
trained, _ = build.assemble(c, build.new_precision(c, cpu), spec, cpu, world, 1e-3)
row["world_holds_all"] = all(sharding.local(w).numel() == w.numel() for w in trained.parameters())
out = Path(os.environ["MIXPREC_TEST_FSDP_PROBE_OUT"]) / f"rank{rank}.json"
out.write_text(json.dumps(row))
dist.destroy_process_group()
