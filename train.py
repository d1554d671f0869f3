"""mixprec's one training entrypoint: `python train.py precision=amp batch=768` (see README.md)."""
import os
import sys
import tempfile

import hydra
from omegaconf import DictConfig

from mixprec.config import register_configs
from mixprec.run import main as run_main

register_configs()
if int(os.environ.get("RANK", "0")) > 0:  # torchrun: only rank 0's Hydra makes a run dir
    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                 f"hydra.run.dir={tempfile.mkdtemp(prefix='mixprec-rank')}"]


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_main(cfg)


if __name__ == "__main__":
    main()
