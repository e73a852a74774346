"""veRL (0.9.1; GPUs, Ray, one node or several) training of the searcher on the same search environment as
the service. Nothing here imports veRL at module level: it runs in the trainer-verl image, and the modules
import (and are tested) without it.

- `agent_loop.py` + `agent_loop.yaml`: the rollout, `trainer.episode.run_episode` over veRL's servers;
- `reward.py`: the reward function, scoring the environment's documents through the services;
- `data.py`: `python -m trainer.verl.data`, the train / val parquet from question files;
- `s3_grpo.yaml`: the GRPO config; `check_config.py`: veRL's own checks of it per GPU layout.

    python -m verl.trainer.main_ppo --config-path="$PLUGSEARCH_VERL_DIR" --config-name=s3_grpo \\
        trainer.n_gpus_per_node=8 trainer.nnodes=1

See trainer/README.md (veRL) for the commands and what was checked.
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
