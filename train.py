"""mixprec's one training entrypoint: `python train.py precision=amp batch=768` (see README.md)."""

import os
import sys

import hydra
from omegaconf import DictConfig

from mixprec.config import compose_config, register_configs
from mixprec.launch import config_errors_exit_2
from mixprec.run import main as run_main

register_configs()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_main(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks: the same config, composed
        run_main(compose_config(sys.argv[1:]))  # without a run dir (rank 0's is broadcast)
    else:
        with config_errors_exit_2():  # Hydra's own config errors (seed=1.5) exit 2, as mixprec's do
            main()
