"""The compact policy itself: `CompactPolicy.decide`, one step in `SearchEnv` (the follow-up search chosen by a
softmax over the candidates, or the end with the `select_k` best documents under the scorer whose evidence the
search has), greedy in serving and sampled in training, and its face to the searcher service."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plugsearch.common.schemas.searcher import Method, SearchMode, SearchParams, search_cost
from plugsearch.searcher.compact.candidates import candidates
from plugsearch.searcher.compact.features import (
    DENSE,
    DENSE_SCORER,
    LEXICAL,
    LEXICAL_SCORER,
    PoolDoc,
    PoolTexts,
    pool_of,
    scoring_features,
)
from plugsearch.searcher.compact.text import QuestionInfo, TextCache
from plugsearch.searcher.compact.weights import (
    DENSE_PREFIX,
    MANIFEST_FILE,
    CompactPolicyError,
    _same_encoder,
    check_weights,
    has_dense_scorer,
    read_folder,
    read_setting,
    write_folder,
)
from plugsearch.searcher.env import Action, InfoBlock, SearchEnv
from plugsearch.searcher.policy import PolicyRefusal, PolicySetting


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits / max(temperature, 1e-6)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


@dataclass
class Decision:
    """One step's action and, for training, what it was chosen from."""

    action: Action
    doc_x: np.ndarray
    """The scoring features of the pool (with the dense evidence when the `dense` scorer chose)."""
    cand_x: np.ndarray | None = None
    """Candidate features of the query choice (row 0 the stop), None when no search was open."""
    choice: int | None = None
    selected: list[int] = field(default_factory=list)
    """Pool indices of the chosen documents, in the order they were drawn (the final selection)."""
    scorer: str = LEXICAL_SCORER
    """Which document scorer chose (`lexical` or `dense`)."""


@dataclass
class CompactPolicy:
    """The policy behind `env.act`: `decide` is one step (greedy, or sampled when given an `rng`)."""

    weights: dict[str, np.ndarray]
    name: str = "compact"
    digest: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    text_cache: TextCache = field(default_factory=TextCache, repr=False, compare=False)
    """Documents' texts as the features read them, across searches (`TextCache(0)`: off)."""
    _texts: weakref.WeakKeyDictionary[SearchEnv, PoolTexts] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)
    """Each running search's `PoolTexts`: its documents read once, whatever the number of steps."""

    @property
    def model(self) -> str:
        """The `policy_model` of its responses (part of the cache key)."""
        return f"{self.name}@{self.digest[:12]}" if self.digest else self.name

    @property
    def setting(self) -> PolicySetting | None:
        """The setting it was trained in, from its manifest (`read_setting`); None when it records none."""
        return read_setting(self.manifest, has_dense=self.has_dense, encoder=self.dense_encoder)

    def search_setting(self) -> dict[str, int]:
        """`retrieve_k`, `select_k` and `max_turns` of its trained setting (what the benches and tools that drive
        it in-process build their `SearchParams` from; empty when it records none)."""
        setting = self.setting
        if setting is None:
            return {}
        return {"retrieve_k": setting.retrieve_k, "select_k": setting.select_k, "max_turns": setting.max_turns}

    # ------------------------------------------------------------------------------------ weights
    @classmethod
    def load(cls, folder: Path) -> CompactPolicy:
        """The policy in `folder` (`weights.read_folder`: digest, shapes, feature names and setting checked)."""
        weights, manifest, digest = read_folder(folder)
        policy = cls(weights, name=str(manifest.get("name", folder.name)), digest=digest, manifest=manifest,
                     folder=folder)
        try:
            if policy.setting is None:
                raise CompactPolicyError("the manifest has no `search` setting (retrieve_k, select_k, max_turns, "
                                         "method, pool_methods): the setting the policy was trained in must "
                                         "travel with it")
        except CompactPolicyError as exc:
            raise CompactPolicyError(f"{folder / MANIFEST_FILE}: {exc}") from exc
        return policy

    def check(self) -> None:
        """Its weights fit the features this code computes (`weights.check_weights`)."""
        check_weights(self.weights)

    @property
    def has_dense(self) -> bool:
        """Whether it ships the `dense` scorer (it then asks for a dense block where `pool_methods` allows)."""
        return has_dense_scorer(self.weights)

    @property
    def dense_encoder(self) -> str | None:
        """The dense encoder its `dense` scorer was trained with (cosines of another encoder do not fit)."""
        if not self.has_dense:
            return None
        return str((self.manifest.get("dense") or {}).get("encoder") or "") or None

    def pool_methods(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        """The methods of its first retrieval on a retriever that serves `served` with dense `encoder`: its
        trained pool (bm25, plus dense when it has the dense scorer), the dense block only where the
        retriever's encoder is the one it was trained with; None (`method` alone: bm25) when the retriever
        does not say what it serves or serves no bm25."""
        if not served or LEXICAL not in served:
            return None
        dense_ok = (self.has_dense and DENSE in served and encoder is not None
                    and _same_encoder(encoder, self.dense_encoder))
        return [m for m in self.trained_pool() if m != DENSE or dense_ok]

    def trained_pool(self) -> list[Method]:
        """The methods of the pool it was trained on: its setting's, else bm25 (+ dense with the dense scorer)."""
        setting = self.setting
        if setting is not None and setting.pool_methods:
            return list(setting.pool_methods)
        return ["bm25", "dense"] if self.has_dense else ["bm25"]

    def save(self, folder: Path, manifest: dict[str, Any]) -> Path:
        """Write `weights.npz` and `manifest.json` (with the weights' digest and the feature names) into `folder`."""
        path, self.digest, self.manifest = write_folder(folder, self.weights, {**manifest, "name": self.name})
        self.folder = folder
        return path

    # ------------------------------------------------------------------------------------ scoring
    def doc_logits(self, x: np.ndarray, scorer: str = LEXICAL_SCORER) -> np.ndarray:
        w = self.weights
        pre = DENSE_PREFIX if scorer == DENSE_SCORER else ""
        h = (x - w[pre + "mean"]) / w[pre + "std"]
        h = np.maximum(h @ w[pre + "w1"] + w[pre + "b1"], 0)
        h = np.maximum(h @ w[pre + "w2"] + w[pre + "b2"], 0)
        return (h @ w[pre + "w3"] + w[pre + "b3"]).reshape(-1)

    def features(self, question: QuestionInfo, pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock],
                 texts: PoolTexts | None = None) -> tuple[np.ndarray, np.ndarray, str]:
        """(lexical features, scoring features, scorer): the scoring features add the dense evidence when
        the search has a dense block and the policy its scorer. `texts`: the search's (`doc_columns`)."""
        return scoring_features(question, pool, blocks, texts, dense=self.has_dense)

    def query_logits(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weights["qv"]

    def decide(self, env: SearchEnv, *, rng: np.random.Generator | None = None, temperature: float = 1.0
               ) -> Decision:
        """The next action in `env`: a follow-up search or the end with the selection. Greedy without `rng`;
        with one, the query is drawn from the candidates' softmax and the selection by Plackett-Luce."""
        texts = self._texts.get(env)
        if texts is None:
            texts = self._texts[env] = PoolTexts(self.text_cache)
        question = QuestionInfo.of(env.question)
        pool = pool_of(env.blocks, texts)
        doc_x, score_x, scorer = self.features(question, pool, env.blocks, texts)
        logits = self.doc_logits(score_x, scorer) if len(pool) else np.zeros(0, dtype=np.float32)
        cand_x, choice = None, None
        if env.can_search and len(pool):
            cands, cand_x = candidates(question, pool, softmax(logits), env.seen_queries, doc_x)
            q_logits = self.query_logits(cand_x)
            prefetch: tuple[str, ...] = ()
            if rng is None:
                choice = int(np.argmax(q_logits))
                if env.searches_left > 1:  # the next search is nearly always this step's runner-up: ask for it now
                    runner_up = next((int(i) for i in np.argsort(-q_logits, kind="stable")
                                      if i != choice and cands[i].kind != "stop"), None)
                    prefetch = (cands[runner_up].query,) if runner_up is not None else ()
            else:
                choice = int(rng.choice(len(cands), p=softmax(q_logits, temperature)))
            if cands[choice].kind != "stop":
                return Decision(Action("search", query=cands[choice].query, prefetch=prefetch), score_x, cand_x,
                                choice, scorer=scorer)
        k = min(env.params.select_k, len(pool))
        if rng is None:
            chosen = [int(i) for i in np.argsort(-logits, kind="stable")[:k]]
        else:
            chosen, left = [], np.ones(len(pool), dtype=bool)
            for _ in range(k):
                p = softmax(np.where(left, logits, -np.inf), temperature)
                i = int(rng.choice(len(pool), p=p))
                chosen.append(i)
                left[i] = False
        picks = tuple((pool[i].block, pool[i].position) for i in chosen)
        return Decision(Action("complete", selected=picks), score_x, cand_x, choice, selected=chosen, scorer=scorer)

    # ------------------------------------------------------------------- the searcher's policy API
    # (`plugsearch.searcher.policy.SearcherPolicy`: what the service asks of the policy it serves)
    @property
    def modes(self) -> tuple[SearchMode, ...]:
        return ("s3",)

    def uses_llm(self, mode: SearchMode) -> bool:
        return False

    def first_retrieval(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        return self.pool_methods(served, encoder)

    def cost(self, params: SearchParams, question_chars: int) -> float:
        """`search_cost` of the retrievals it may make, no LLM call: its trained pool (one block per method,
        whatever the retriever serves at the moment: the guess before the search is what it is charged) and
        `max_turns` follow-ups."""
        pool = params.model_copy(update={"pool_methods": list(self.trained_pool())})
        return search_cost(pool, question_chars, llm_policy=False)

    def check_request(self, params: SearchParams, *, method_asked: Method | None) -> None:
        """s3 only; the request's `method` only where it is the trained one (bm25): a dense or hybrid block
        read as BM25 evidence would run the policy outside what it was trained on."""
        if params.mode not in ("s3", "naive"):
            raise PolicyRefusal(f"this searcher's policy ({self.model}) runs s3 and naive searches; "
                                f"{params.mode} needs an LLM policy (SEARCHER_POLICY_KIND=llm)", param="mode")
        setting = self.setting
        trained = setting.method if setting is not None and setting.method else LEXICAL
        if params.mode == "s3" and method_asked is not None and method_asked != trained:
            raise PolicyRefusal(f"method {method_asked!r}: this searcher's policy ({self.model}) was trained on "
                                f"{trained!r} follow-up searches and a pool it retrieves itself; leave method "
                                f"unset (or {trained!r}) for s3, or use mode naive for a {method_asked} top-k",
                                param="method")

    async def act(self, env: SearchEnv) -> Action:
        return self.decide(env).action

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
