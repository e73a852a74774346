"""`SearcherSettings`: env prefix `SEARCHER_`, nested upstreams `SEARCHER_RETRIEVER__URL`, `SEARCHER_POLICY__BASE_URL`."""

from __future__ import annotations

import json
from pathlib import Path
from string import Template
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from plugsearch.common.http import ClientSettings
from plugsearch.common.llm import LLMSettings
from plugsearch.common.schemas.chat import Extension
from plugsearch.common.schemas.searcher import ConstraintStyle, SearchMode, check_select_k
from plugsearch.common.settings import AdminKeySettings
from plugsearch.searcher.prompts import PromptSet

DEFAULT_CHAT_TEMPLATE = """Answer the question using the documents below where they are relevant.

$context

Question: $question"""


class ChatProxySettings(BaseModel):
    """Opt-in OpenAI-compatible answering proxy (`POST /v1/chat/completions`): set at least
    `SEARCHER_CHAT__ANSWER__BASE_URL` (any OpenAI-compatible endpoint) and `SEARCHER_CHAT__ANSWER__MODEL`."""

    answer: LLMSettings = Field(..., description="the LLM that answers, given the search's context")
    mode: SearchMode = Field("s3", description="search mode when the request sets none")
    template: str = Field(DEFAULT_CHAT_TEMPLATE, description=(
        "replaces the last user message: `$context` (the documents found) and `$question` (the message)"))
    model_name: str = Field("plugsearch", min_length=1, description="the model id GET /v1/models lists")
    max_tokens: int = Field(256, ge=1, le=32_768, description=(
        "answer tokens when a request sets no max_tokens (forwarded, so every generation has a bound)"))
    max_tokens_limit: int = Field(1024, ge=1, le=32_768, description=(
        "the most answer tokens a request may ask for (max_tokens, max_completion_tokens, min_tokens); "
        "more is 422 cost_limit_exceeded before any work"))
    max_prompt_chars: int = Field(8_000, ge=100, le=1_000_000, description=(
        "the most characters of the caller's own messages (their text, plus the tool definitions) one request may "
        "send; more is 422 cost_limit_exceeded before any work. With max_context_chars and max_tokens_limit it "
        "bounds the work one answer is (llama.cpp: keep their tokens inside its context window, ~3 characters a "
        "token at worst)"))
    max_context_chars: int = Field(8_000, ge=100, le=1_000_000, description=(
        "the most characters of documents pasted into the prompt: the search's documents in order, those past "
        "this left out (the first one cut when it alone is longer)"))
    extensions: list[Extension] = Field(default_factory=list, description=(
        "backend extensions forwarded when a request uses them (JSON list): top_k, min_p, typical_p, "
        "repeat_penalty (llama.cpp), repetition_penalty (vLLM), mirostat (mirostat_mode / _tau / _eta, llama.cpp), "
        "image_url (image content parts, for an answer LLM that reads images); otherwise they are 422. "
        "llama.cpp's `grammar` is never forwarded (a malformed one crashes its server)"))

    @model_validator(mode="after")
    def _check_tokens(self) -> ChatProxySettings:
        if self.max_tokens > self.max_tokens_limit:
            raise ValueError("chat max_tokens must be at most max_tokens_limit")
        return self

    @field_validator("template")
    @classmethod
    def _check_template(cls, value: str) -> str:
        names = set(Template(value).get_identifiers())  # well-formed ones; `is_valid` checks the rest
        if not Template(value).is_valid() or not names <= {"context", "question"} or "context" not in names:
            raise ValueError("the chat template must use $context (and may use $question), nothing else; "
                             "write $$ for a literal $")
        return value


class SearcherSettings(AdminKeySettings):
    model_config = SettingsConfigDict(env_prefix="SEARCHER_", env_nested_delimiter="__", extra="ignore")

    retriever: ClientSettings = Field(default_factory=ClientSettings)  # the retriever's default port, 8001
    policy: LLMSettings = Field(default_factory=LLMSettings)

    # Defaults of every search (per-request overridable): the s3 paper's best setting. For s3 searches with
    # the compact policy, its trained setting replaces retrieve_k, select_k and max_turns unless they are set
    # explicitly here (SEARCHER_RETRIEVE_K, ...: logged at start-up, as they run the policy outside it).
    max_turns: int = Field(3, ge=0, le=10)
    retrieve_k: int = Field(8, ge=1, le=50)
    select_k: int = Field(3, ge=1, le=50)
    constrained: bool = Field(False, description="constrained decoding (grammar) by default")
    constraint_style: ConstraintStyle = Field("llama", description="llama: `grammar`; vllm: structured_outputs")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    max_new_tokens: int = Field(160, ge=8, le=4096)
    max_invalid: int = Field(2, ge=0, le=10, description="invalid actions in a row before falling back")
    max_queries_per_round: int = Field(3, ge=1, le=10)
    doc_chars: int | None = Field(None, ge=50, description="cut documents shown to the policy (small contexts)")
    search_timeout_s: float = Field(90.0, gt=0, description="budget of one search loop; past it: degraded")
    batch_concurrency: int = Field(8, ge=1, le=256, description="searches of one batch run at once")
    retriever_wait_s: float = Field(20.0, ge=0, description=(
        "how long a retrieval waits for a retriever that cannot be reached or is not ready (restarting: its "
        "supervisor, compose or Kubernetes brings it back), polling, before the search fails with 503; "
        "0 = fail at once"))
    retriever_max_batch: int = Field(64, ge=1, le=4096, description=(
        "concurrent retrievals (same k and method) merged into one retriever request, up to this many "
        "queries; 1 = one request per retrieval"))
    max_request_cost: float = Field(128.0, gt=0, description=(
        "most cost units one request may ask for (`search_cost`: default s3 search 16; a batch: the sum of "
        "its items); more is 422 cost_limit_exceeded. Applies to API-key callers (and anonymous ones with "
        "limit_anonymous), never to the internal token"))
    rate_limit_per_s: float = Field(20.0, ge=0, description=(
        "cost units per second each API key may spend (token bucket, shared through Redis when redis_url is "
        "set); past it 429 rate_limited + Retry-After; 0 = no rate limit"))
    rate_limit_burst: float = Field(256.0, gt=0, description="cost units a key may spend at once (the bucket)")
    llm_slots: int = Field(16, ge=1, le=4096, description=(
        "LLM-bound requests (s3 / QAgent searches with an LLM policy, chat answers) the LLM serves at once "
        "without queueing, shared fairly between API keys (plugsearch.common.admission.FairShare): a key alone "
        "may use them all; with others active it may hold or wait for max(1, llm_slots / active keys), past it "
        "429 rate_limited + Retry-After. When every slot is held, requests wait for one (llm_wait_s), served "
        "across keys in turn. llama.cpp serves one request at a time (the local stack sets 1); vLLM many "
        "(its max_num_seqs)"))
    llm_wait_s: float = Field(60.0, ge=0, description=(
        "how long an LLM-bound request waits for a slot while other keys hold them all; past it 429 "
        "rate_limited + Retry-After"))
    limit_anonymous: bool = Field(False, description=(
        "apply the cost bound and the rate limit to callers without a key too (one bucket per client "
        "address), when no API keys are configured"))
    cache_enabled: bool = True
    index_id_ttl_s: float = Field(10.0, ge=0, description=(
        "how often what the retriever says of its index (methods, encoder, corpus, changes: GET /version) is read "
        "again; the index identity in every cache key is read before each cached answer (GET /index), so no "
        "answer cached before a change the retriever acknowledged is served"))
    chat: ChatProxySettings | None = Field(None, description=(
        "the OpenAI-compatible answering proxy (POST /v1/chat/completions); off unless configured"))
    ui: bool = Field(False, description=(
        "serve the search playground (a static page) at GET /ui; the local stack turns it on"))
    policy_kind: Literal["auto", "compact", "llm"] = Field("auto", description=(
        "which policy drives s3 searches. compact = the compact learned policy of compact_policy, in-process, "
        "no LLM, the setting its manifest records as the defaults of s3 searches; llm = the chat LLM at "
        "SEARCHER_POLICY__BASE_URL (s3 and QAgent, the service's own defaults); auto (default) = llm when a "
        "policy LLM is configured (any SEARCHER_POLICY__* setting), else compact"))
    compact_policy: Path = Field(Path("packaged"), description=(
        "folder of the compact learned policy (`weights.npz` + `manifest.json`, plugsearch/searcher/compact/); "
        "`packaged` (default) = the one shipped in the package. Checked at start-up: the weights against the "
        "manifest's digest, their shapes, and the setting it was trained in (retrieve_k, select_k, max_turns, "
        "the follow-up method, the pool's methods, the dense encoder)"))
    compact_dense: Literal["auto", "on", "off"] = Field("auto", description=(
        "the compact policy's first retrieval: BM25, plus the dense top-k for its dense scorer. auto: when the "
        "retriever's /version says it serves dense search with the encoder that scorer was trained with; on: "
        "always (the retriever must serve it); off: BM25 alone (its lexical scorer)"))
    corpus_check: Literal["auto", "off"] = Field("auto", description=(
        "whether the compact policy measures itself on the served corpus before it serves it "
        "(plugsearch/searcher/corpus_check.py): auto (default) = on a corpus its manifest's evaluation does not "
        "cover, pseudo-questions from the corpus's passages searched by the policy and by naive BM25 top-k; "
        "where the policy finds fewer answers (by more than corpus_check_margin), s3 searches return naive BM25 "
        "top-k and say so (`fallback`, /version). off = serve the policy unchecked"))
    corpus_check_margin: float = Field(0.0, ge=0.0, le=1.0, description=(
        "how much lower than naive BM25's the policy's answer recall on the pseudo-questions may be and it "
        "still serves"))
    corpus_check_questions: int = Field(300, ge=30, le=2000, description=(
        "pseudo-questions the corpus check makes (from twice as many sampled passages)"))
    corpus_check_qa: Path | None = Field(None, description=(
        "your labelled questions of the served corpus (JSONL rows as plugsearch-train compact --qa reads them: "
        "`question` with `golden_answers` and / or `passage_ids`; questions the policy was not trained on): the "
        "corpus check searches them instead of pseudo-questions, and they take precedence over the policy's own "
        "evaluation. Read and checked at start-up (a bad row refuses to start, with its line); yes/no questions "
        "are left out, the first corpus_check_questions used"))
    corpus_check_recheck_share: float = Field(0.05, gt=0.0, le=1.0, description=(
        "the share of the served passages that must have been put or deleted (the retriever's /version "
        "`changes.passages`) since the verdict before the corpus check runs again; smaller changes keep the "
        "verdict"))
    corpus_check_min_interval_s: float = Field(600.0, ge=0.0, description=(
        "at least this long between two checks of the same index as documents change (the first check of an "
        "index, e.g. when the dense index arrives, is not held back)"))
    policy_manifest: Path | None = Field(None, description=(
        "with policy_kind llm: the manifest of the trained LLM searcher it serves (its `manifest.json`, e.g. "
        "plugsearch/searcher/trained/smollm2-s3/manifest.json): the setting it records (`search`: retrieve_k, "
        "select_k, max_turns) gives the defaults of its s3 searches, as a compact policy's manifest does; "
        "plugsearch-stack --policy trained sets it. Checked at start-up"))
    feedback: Literal["on", "off"] = Field("on", description=(
        "keep marks from use: every answer gets a `search_id`, and POST /feedback stores which of its documents "
        "helped (plugsearch/searcher/feedback/, docs/training.md \"Marks from use\"); off: no ids, no file"))
    feedback_db: Path = Field(Path("var/feedback/searcher.sqlite3"), description=(
        "the SQLite file of searches and marks (relative: to the working directory; plugsearch-stack keeps it in "
        "its --var-dir). Every worker of this searcher shares it; it belongs to one host (not a network file "
        "system): replicas on several hosts each keep their own"))
    feedback_max_searches: int = Field(100_000, ge=100, description=(
        "searches nobody marked kept at most (oldest dropped first); a marked search is kept with its mark"))
    feedback_search_ttl_s: float = Field(7 * 24 * 3600.0, gt=0, description=(
        "how long a search can be marked; unmarked, it is dropped after it"))
    feedback_max_marks: int = Field(100_000, ge=100, description="marks kept at most (oldest dropped first)")
    feedback_mark_ttl_s: float = Field(365 * 24 * 3600.0, gt=0, description="how long a mark is kept")
    feedback_text_chars: int = Field(0, ge=0, le=5000, description=(
        "characters of each returned document's text kept with a search (0: ids and titles only; the corpus "
        "holds the text)"))
    prompts_dir: Path | None = Field(None, description=(
        "folder of prompt templates replacing the packaged ones (`<mode>.<part>.txt`, see "
        "plugsearch/searcher/prompts); checked at start-up, part of the cache key"))

    def chat_manifest(self) -> dict[str, Any]:
        """The LLM policy's manifest (`policy_manifest`; empty when none), its setting checked. Raises
        `ValueError` saying what is wrong, with the file."""
        if self.policy_manifest is None:
            return {}
        from plugsearch.searcher.policy import read_chat_setting

        path = self.policy_manifest
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(manifest, dict):
                raise ValueError("not a JSON object")
            read_chat_setting(manifest)
        except (OSError, ValueError, ValidationError) as exc:
            raise ValueError(f"policy_manifest {path}: {exc}") from exc
        return manifest

    @model_validator(mode="after")
    def _check_searcher(self) -> SearcherSettings:
        check_select_k(None, self.select_k, self.retrieve_k)
        if str(self.compact_policy) == "packaged":
            from plugsearch.searcher.trained import COMPACT_DIR

            self.compact_policy = COMPACT_DIR
        if self.policy_kind == "auto":
            self.policy_kind = "llm" if "policy" in self.model_fields_set else "compact"
        if self.policy_kind == "compact":
            from plugsearch.searcher.compact import CompactPolicy

            CompactPolicy.load(self.compact_policy)  # refuse a bad folder or manifest at start-up, with the reason
        if self.policy_manifest is not None:
            self.chat_manifest()  # refuse a bad manifest at start-up, with the reason
        if self.corpus_check_qa is not None:
            from plugsearch.searcher.corpus_check import read_labelled

            try:  # refuse a missing file or a bad row at start-up, with its line
                read_labelled(self.corpus_check_qa)
            except ValueError as exc:
                raise ValueError(f"corpus_check_qa: {exc}") from exc
        if self.prompts_dir is not None:
            PromptSet.load(self.prompts_dir)  # refuse a bad folder at start-up, with the file and variable
        if self.rate_limit_per_s and self.rate_limit_burst < self.max_request_cost:
            raise ValueError("rate_limit_burst must be at least max_request_cost, or the largest request "
                             "allowed could never be afforded")
        if self.search_timeout_s >= self.request_timeout_s:
            raise ValueError("search_timeout_s must be below request_timeout_s so a slow search degrades, not 504s")
        return self
