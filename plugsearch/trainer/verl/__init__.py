"""veRL (0.9.1; GPUs, Ray) training of the searcher on the same search environment as the service. Nothing
here imports veRL at module level: the modules import (and are tested) without it.

    python -m verl.trainer.main_ppo --config-path="$PLUGSEARCH_VERL_DIR" --config-name=s3_grpo \\
        trainer.n_gpus_per_node=8 trainer.nnodes=1

See plugsearch/trainer/README.md (veRL) for the commands and what was checked.
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
