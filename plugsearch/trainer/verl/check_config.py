"""Check `s3_grpo.yaml` with veRL's own code, for each GPU layout, without GPUs or a cluster.

    python -m plugsearch.trainer.verl.check_config [--layout 1x1 --layout 1x8 --layout 2x8] [OVERRIDE ...]

Run it where veRL is installed (see plugsearch/trainer/README.md). Per NODESxGPUS layout it composes the config as
`verl.trainer.main_ppo` does and runs what veRL runs before it starts workers: `validate_config`, the config
dataclasses' `__post_init__` checks, `batch_problems` (what the workers assert at run time), the agent loop
registry and the reward function loader. Exit status 0 when every layout passes.
"""

from __future__ import annotations

import argparse
import json
import logging
import operator
import sys
from collections.abc import Mapping, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

from plugsearch.trainer.verl import CONFIG_DIR

logger = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"
"""The veRL release this config and the agent loop follow (pinned by the `verl` extra and the image)."""

LAYOUTS = ("1x1", "1x8", "2x8")
"""NODESxGPUS_PER_NODE: one GPU, one 8-GPU node, two 8-GPU nodes (the RayJob)."""


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    return reduce(operator.getitem, dotted.split("."), config)


def batch_problems(config: Mapping[str, Any], *, nnodes: int, gpus_per_node: int) -> list[str]:
    """The batch divisibility veRL 0.9.1's FSDP workers (no dynamic batch sizes) assert at run time, each
    problem as a sentence (empty when it all holds). Where veRL checks them: `workers/engine_workers.py`
    (init_model, train_mini_batch), `workers/rollout/replica.py` (a replica fits a node), `utils/config.py`
    (validate_config), `trainer/ppo/v1/trainer_base.py` (_update_actor; _get_required_batch_multiple pads a
    step that is not whole mini-batches with synthetic samples: wasted GPU work, so a problem here) and
    `workers/engine/utils.py` (prepare_micro_batches). `config`: the composed config or `s3_grpo.yaml` alone."""
    gpus = nnodes * gpus_per_node
    problems: list[str] = []
    actor = _get(config, "actor_rollout_ref.actor")
    rollout = _get(config, "actor_rollout_ref.rollout")
    n = int(rollout["n"])
    step = int(_get(config, "data.train_batch_size")) * n
    engine = int(rollout["tensor_model_parallel_size"]) * int(rollout["data_parallel_size"]) * int(
        rollout["pipeline_model_parallel_size"])
    if gpus % engine:
        problems.append(f"{gpus} GPUs not divisible by a rollout engine's {engine} GPUs")
    if engine % min(gpus_per_node, engine):
        problems.append(f"a rollout engine's {engine} GPUs do not fit nodes of {gpus_per_node}")
    if step % gpus:
        problems.append(f"train_batch_size x n = {step} not divisible by {gpus} GPUs")
    dp = gpus // int(actor["ulysses_sequence_parallel_size"])
    mini = int(actor["ppo_mini_batch_size"]) * n
    if mini % dp:
        problems.append(f"ppo_mini_batch_size x n = {mini} not divisible by data-parallel size {dp}")
    elif not actor["use_dynamic_bsz"]:
        micro = int(actor["ppo_micro_batch_size_per_gpu"])
        if (mini // dp) % micro:
            problems.append(f"{mini // dp} trajectories per GPU per mini-batch not divisible by "
                            f"ppo_micro_batch_size_per_gpu {micro}")
        for role in ("rollout", "ref"):
            infer = int(_get(config, f"actor_rollout_ref.{role}.log_prob_micro_batch_size_per_gpu"))
            if step % dp == 0 and (step // dp) % infer:
                problems.append(f"{step // dp} trajectories per GPU not divisible by {role}."
                                f"log_prob_micro_batch_size_per_gpu {infer}")
    if step % mini:
        problems.append(f"a step of {step} trajectories is not a whole number of mini-batches of {mini}: veRL pads it")
    return problems


def compose(overrides: Sequence[str], *, config_dir: Path = CONFIG_DIR, name: str = "s3_grpo") -> Any:
    """The config `python -m verl.trainer.main_ppo --config-path=<config_dir> --config-name=<name>` sees."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides))


def check_layout(layout: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """veRL's checks for one NODESxGPUS layout; raises on the first failure."""
    import inspect

    import yaml
    from verl.trainer.ppo.reward import get_custom_reward_fn, resolve_reward_manager_cls
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.import_utils import resolve_config_path

    nnodes, gpus_per_node = (int(x) for x in layout.split("x"))
    config = compose([f"trainer.nnodes={nnodes}", f"trainer.n_gpus_per_node={gpus_per_node}", *overrides])
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    for section in ("actor_rollout_ref.rollout", "actor_rollout_ref.actor", "algorithm"):
        omega_conf_to_dataclass(_get(config, section))
    problems = batch_problems(config, nnodes=nnodes, gpus_per_node=gpus_per_node)
    if problems:
        raise ValueError("; ".join(problems))
    agent = config.actor_rollout_ref.rollout.agent
    registry = yaml.safe_load(Path(resolve_config_path(agent.agent_loop_config_path)).read_text(encoding="utf-8"))
    names = [str(entry["name"]) for entry in registry]
    if agent.default_agent_loop not in names:
        raise ValueError(f"default_agent_loop {agent.default_agent_loop} is not in {agent.agent_loop_config_path}")
    # what veRL's reward loop workers load: the manager class and our (async) reward function
    manager = resolve_reward_manager_cls(config)
    reward_fn = get_custom_reward_fn(config)
    if reward_fn is None or not inspect.iscoroutinefunction(reward_fn):
        raise ValueError("reward.custom_reward_function must load as an async function")
    return {"layout": layout, "gpus": nnodes * gpus_per_node, "ok": True, "agent_loops": names,
            "reward_manager": manager.__name__,
            "trajectories_per_step": int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    parser = argparse.ArgumentParser(prog="python -m plugsearch.trainer.verl.check_config", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", help=f"NODESxGPUS (default: {' '.join(LAYOUTS)})")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as on main_ppo's command line")
    args = parser.parse_args(argv)
    import verl

    if verl.__version__ != VERL_VERSION:
        logger.warning("veRL %s installed; this config follows %s", verl.__version__, VERL_VERSION)
    failed = 0
    for layout in args.layout or LAYOUTS:
        try:
            result = check_layout(layout, args.overrides)
        except Exception as exc:  # noqa: BLE001 - reported per layout, the exit status says it failed
            failed += 1
            result = {"layout": layout, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        logger.info("%s", json.dumps({"verl": verl.__version__, **result}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
