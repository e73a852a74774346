"""`accelerate launch` configs for the TRL trainer on the GPUs of one node: `ddp.yaml` (a full copy of the
policy per GPU) and `fsdp.yaml` (FSDP 2, parameters, gradients and optimizer state sharded), 8 processes,
bf16. The trainer image copies this folder to /opt/plugsearch/accelerate (the k8s train overlay's Job).
"""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
