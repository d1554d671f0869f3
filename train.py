"""mixprec's one training entrypoint: `python train.py precision=amp batch=768` (see README.md)."""

import gc

gc.disable()  # until the imports are done (frozen below): collecting them mid-import is wasted

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from mixprec.core import early  # noqa: E402
from mixprec.internals import quick_exit  # noqa: E402

quick_exit.install()  # first: its atexit handler runs last, then skips the interpreter teardown
early.start(sys.argv[1:])  # the precision's early work (its YAML's `early:`), during the imports

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mixprec.core.launch import config_errors_exit_2  # noqa: E402
from mixprec.run.config import compose_config, register_configs  # noqa: E402
from mixprec.run.session import main as run_main  # noqa: E402

# What the imports made (torch's, timm's, Hydra's objects) lives as long as the process: frozen,
# out of the collector's sight, the collections Python starts during training stop walking it.
# (gc.disable() early, gc.freeze() before forking, as the gc module's documentation advises.)
gc.freeze()
gc.enable()
register_configs()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_main(cfg)


def entry() -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0:  # torchrun's other ranks: the same config, composed without a run dir (rank
        # 0's is broadcast) and quiet but for errors: the first rank to fail ends the others,
        # and a config error must be said by whichever rank that is
        logging.basicConfig(
            level=logging.ERROR,
            format=f"[rank {rank}][%(name)s][%(levelname)s] - %(message)s",
            force=True,
        )
        run_main(compose_config(sys.argv[1:]))
    else:
        with config_errors_exit_2():  # Hydra's own config errors (seed=1.5) exit 2, as mixprec's do
            main()


if __name__ == "__main__":
    try:
        entry()
    except SystemExit as e:
        quick_exit.exiting_with(e.code)
        raise
    else:
        quick_exit.exiting_with(0)  # an exception (a traceback, Ctrl-C) leaves the exit to Python
