"""The compact trainer's setting: one dataclass, the one source of its defaults (`plugsearch-train compact`'s
flags read theirs from it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import DENSE
from plugsearch.trainer.common.rewards import Baseline

TRAIN_SETS = ("nq", "hotpotqa", "2wikimultihopqa", "popqa")
NEVER_TRAIN = frozenset({"musique", "bamboogle", "triviaqa"})
FIRST_TRAIN_ROW = 200


@dataclass
class CompactConfig:
    datasets: tuple[str, ...] = TRAIN_SETS
    """The shipped question sets trained on (rows `offset`..; not with a user's `--qa` files)."""
    offset: int = FIRST_TRAIN_ROW
    per_dataset: int = 750
    """Training rows per shipped set, from row `offset` on."""
    dev_per_dataset: int = 50
    """The last this many of each set's training rows are held out to watch the RL stage (never trained on)."""
    retrieve_k: int = 30
    """Documents per retrieval (the pool)."""
    select_k: int = 3
    """Documents returned."""
    max_turns: int = 2
    """Follow-up searches at most."""
    hidden: tuple[int, int] = (32, 16)
    warm_epochs: int = 30
    warm_lr: float = 3e-3
    rl_steps: int = 600
    questions_per_step: int = 32
    group: int = 4
    """Sampled searches per question (the group baseline)."""
    rl_lr: float = 1e-3
    temperature: float = 0.5
    """Softmax temperature of the sampled actions in RL (1.0 explored too little to learn follow-up searches)."""
    save_every: int = 10
    seed: int = 0
    dense: bool = True
    """The pool adds the dense retriever's top `retrieve_k` (the `dense` scorer is trained and RL runs with it)."""
    reward: str = "recall"
    """recall: GBR with GenAcc's span check on the documents, no LLM; gbr: GenAcc of the frozen generator's
    answers, judged, through the services."""
    baseline: Baseline = "same_n"
    """GBR's naive documents: same_n (naive top-n at the n documents returned) or top_k (naive top-3)."""

    def search_params(self) -> SearchParams:
        return SearchParams(mode="s3", retrieve_k=self.retrieve_k, select_k=self.select_k, max_turns=self.max_turns,
                            method="bm25", pool_methods=["bm25", DENSE] if self.dense else ["bm25"])

    def search_setting(self) -> dict[str, Any]:
        """The `search` section of the policy's manifest: the setting the service applies when it loads it."""
        return {"mode": "s3", "retrieve_k": self.retrieve_k, "select_k": self.select_k, "max_turns": self.max_turns,
                "method": "bm25", "pool_methods": self.search_params().pool_methods}


def default(name: str) -> Any:
    """`CompactConfig`'s default of field `name` (what a flag defaults to)."""
    for f in fields(CompactConfig):
        if f.name == name:
            return f.default
    raise KeyError(name)


def config_dict(config: CompactConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
