"""Does compiled ResNet-50's backward recompute the stem max-pool or read saved offsets? Prints the
pooling ops of the forward and backward graphs that torch.compile's partitioner (min-cut, with
inductor's decompositions, as in experiment=fast) produces. Runs on a CPU in about a minute.

    python3 benchmarks/maxpool_partition.py

Seen on torch 2.14 (benchmarks/RESULTS.md, session 8): the forward runs
`_low_memory_max_pool_with_offsets` and hands its int8 offsets to the backward, which only runs
`_low_memory_max_pool_offsets_to_indices`: no recompute.
"""

from __future__ import annotations

import timm
import torch
import torch._inductor.lowering  # noqa: F401  (inductor's decompositions refer to it)
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table


def main() -> None:
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("forward"),
        bw_compiler=keep("backward"),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    model = timm.create_model("resnet50", num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(model, backend=backend)(x).float().sum()
    loss.backward()
    for name, gm in graphs.items():
        pools = [str(n.target) for n in gm.graph.nodes if "pool" in str(n.target)]
        saved_int8 = [
            n.name
            for n in gm.graph.nodes
            if n.op == "placeholder" and getattr(n.meta.get("val"), "dtype", None) == torch.int8
        ]
        print(f"{name}: pooling ops {pools}; int8 inputs {saved_int8}")


if __name__ == "__main__":
    main()
