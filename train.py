"""mixprec's one training entrypoint: `python train.py precision=amp batch=768` (see README.md)."""

import os
import sys

import hydra
from omegaconf import DictConfig

from mixprec.config import compose_config, register_configs
from mixprec.run import main as run_main

register_configs()


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_main(cfg)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks: the same config, composed
        run_main(compose_config(sys.argv[1:]))  # without a run dir (rank 0's is broadcast)
    else:
        main()
