"""The compact searcher policy: a small learned scorer that acts in `SearchEnv` on the CPU, with no LLM.

It takes s3's steps through the environment's actions:
1. the environment's first retrieval of the question is the pool: BM25's `retrieve_k` documents and, when
   the retriever serves dense search with the encoder the policy was trained with (`pool_methods`), the
   dense top `retrieve_k` too (one block each, `SearchParams.pool_methods`);
2. up to `max_turns` follow-up searches, each chosen among candidates built from what was retrieved (the
   title of a high-scoring document with the question's words it lacks, or a name that document's text
   introduces), or a stop; the choice is a softmax over candidate features;
3. the selection: the `select_k` best documents of the whole pool under a small MLP over per-document
   features (BM25 evidence: score, rank and z-score in its block; lexical overlap with the question; links
   between documents: a document whose title another document that matches the question mentions, the
   bridge of a two-hop question, titles compared without their "(disambiguation)" and ", place" parts;
   answer-type cues such as a year for a "when" question) and, with the dense block, the dense evidence
   (cosine, its gap to the best and z-score in the block, rank, and which retrievers found the document).
   Two scorers ship: `lexical` (BM25 pool alone) and `dense` (both blocks); the one whose evidence is there
   scores.

Nothing here depends on a passage's length: the corpus's gold passages are often shorter than the others,
and a length feature would be a shortcut that real corpora do not have.

Its rooms, by job:
- `text`: how it reads a question, a title and a document's text (once per document, cached across searches);
- `features`: the pool and the document features, each row built by name (`scoring_features` joins the
  lexical and dense ones for serving and for the trainer's warm start alike);
- `candidates`: the follow-up searches open at a step and their features;
- `weights`: the folder (`weights.npz` + `manifest.json`), its digest, its feature names and its setting;
- `policy`: `CompactPolicy`, one step (`decide`: greedy, or sampled for training) and its face to the service.

Inference is numpy only, so the searcher image needs no torch; the trainer (`plugsearch.trainer.compact`) trains the same
parameters in torch and samples actions through `decide(..., rng=...)`.
"""

from plugsearch.searcher.compact.candidates import CANDIDATE_FEATURES, Candidate, candidates, title_query
from plugsearch.searcher.compact.features import (
    ABSENT_COSINE_GAP,
    DENSE,
    DENSE_FEATURES,
    DENSE_SCORER,
    DOC_FEATURES,
    LEXICAL,
    LEXICAL_SCORER,
    PoolDoc,
    PoolTexts,
    dense_features,
    doc_features,
    pool_of,
    scoring_features,
)
from plugsearch.searcher.compact.policy import CompactPolicy, Decision, softmax
from plugsearch.searcher.compact.text import QuestionInfo, TextCache, title_core, title_head
from plugsearch.searcher.compact.weights import DENSE_PREFIX, CompactPolicyError, read_setting

__all__ = [
    "ABSENT_COSINE_GAP", "CANDIDATE_FEATURES", "DENSE", "DENSE_FEATURES", "DENSE_PREFIX", "DENSE_SCORER",
    "DOC_FEATURES", "LEXICAL", "LEXICAL_SCORER", "Candidate", "CompactPolicy", "CompactPolicyError", "Decision",
    "PoolDoc", "PoolTexts", "QuestionInfo", "TextCache", "candidates", "dense_features", "doc_features", "pool_of",
    "read_setting", "scoring_features", "softmax", "title_core", "title_head", "title_query",
]
