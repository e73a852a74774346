"""`bench/train_gpu_check.py --device cpu`: two GRPO steps of a tiny random Qwen2 model through the real
environment, rollout, reward and TRL update; the mask holds and the ids trained on are the ids sampled.
On a GPU machine the same script runs with `--device cuda` (see plugsearch/trainer/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gpu_check_passes_on_the_cpu(data_dir: Path, var_dir: Path) -> None:
    done = subprocess.run([sys.executable, "bench/train_gpu_check.py", "--device", "cpu", "--data", str(data_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["dtype"] == "float32" and result["steps"] == 2
    assert result["masked_grad_max"] == 0.0
    assert result["unmasked_grad_max"] > 0.0
    assert result["tokens_match_sampled"] is True
    assert result["seconds_per_step"] > 0
