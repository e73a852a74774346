"""`accelerate launch` configs for the TRL trainer on several GPUs of one node (`plugsearch-train train` under
`accelerate launch --config_file <this folder>/<ddp|fsdp>.yaml -m trainer.cli train --device cuda ...`).

- `ddp.yaml`: data parallel, a full copy of the policy per GPU (policies up to ~3B on 80 GB GPUs, with
  vLLM colocated);
- `fsdp.yaml`: FSDP 2, parameters, gradients and optimizer state sharded over the GPUs (larger policies).

Both: 8 processes (one per GPU), bf16 mixed precision (`--precision bf16`). The trainer image copies this
folder to /opt/plugsearch/accelerate (the k8s train overlay's Job reads it there); checked with accelerate's
own config loader and launch parser in tests/unit/test_deploy_train.py.
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
