"""The compact searcher policy: a small learned scorer that acts in `SearchEnv` on the CPU, with no LLM.

It takes s3's steps through the environment's structured actions (`env.act`):
1. the environment's first retrieval of the question is the pool: BM25's `retrieve_k` documents and, when
   the retriever serves dense search with the encoder the policy was trained with (`pool_methods`), the
   dense top `retrieve_k` too (one block each, `SearchParams.pool_methods`);
2. up to `max_turns` follow-up searches, each chosen among candidates built from what was retrieved (the
   question with the title of a high-scoring document, or a name that document's text introduces), or a
   stop; the choice is a softmax over candidate features;
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

The weights (`weights.npz`, a few kB) and `manifest.json` (how they were trained and evaluated, and their
sha256) live in a folder; `CompactPolicy.load` refuses weights whose digest does not match. Inference is
numpy only, so the searcher image needs no torch; the trainer (`trainer.compact`) trains the same
parameters in torch and samples actions through `decide(..., rng=...)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.common.schemas.searcher import SearchedDocument
from services.searcher import parsing
from services.searcher.env import Action, InfoBlock, SearchEnv

WEIGHTS_FILE = "weights.npz"
MANIFEST_FILE = "manifest.json"
MLP_KEYS = ("mean", "std", "w1", "b1", "w2", "b2", "w3", "b3")
DENSE_PREFIX = "dense_"
"""The dense scorer's weights: `dense_mean`, ..., `dense_b3` (optional: a policy without them is lexical only)."""
QUERY_KEYS = ("qv",)
_PAREN = re.compile(r"\s*\([^)]*\)\s*$")

_WORD = re.compile(r"\w+")
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
_NUM = re.compile(r"\b\d+\b")
_CAP = re.compile(r"\b[A-Z][a-z]+")
_STOP = frozenset(
    "a an the of in on at to for and or is was were are be been by with from as that this which who what when "
    "where how did does do whose whom why it its his her their he she they than then there".split())
WH = ("when", "where", "who", "what", "which", "how many", "how much", "year")
LINK_WINDOW = 10
"""Links between documents are looked for among the first this many documents of the pool."""
MAX_ENTITY_CANDIDATES = 2
MAX_TITLE_CANDIDATES = 3

DOC_FEATURES = (
    "score_rel", "inv_rank", "log_rank", "follow_up", "title_in_q", "title_full_in_q", "q_coverage",
    "mentioned_by", "mentions", "has_year", "has_number", "cap_density", "when_year", "year_year",
    "who_names", "how_many_number", "how_much_number", "linked_from_anchor", "links_to_anchor",
    "has_new_name", "score_z", "is_anchor",
    # titles without their disambiguation: "Machine Head (band)" -> core "machine head", "Davenport, Florida"
    # -> head "davenport"; anchors by core
    "core_in_q", "core_coverage", "is_core_anchor", "core_linked_from_anchor", "head_linked_from_anchor",
    "core_links_to_anchor", "head_links_to_anchor", "head_linked_from_top3", "same_title_above",
    "head_linked_in_top10", "has_core_anchor", "core_anchor_count",
)
DENSE_FEATURES = (
    "in_lexical", "cosine", "cosine_gap", "cosine_z", "in_dense", "dense_inv_rank", "lexical_inv_rank",
)
"""Dense evidence of the pool's documents (the `dense` scorer only): a document the dense block lacks gets
its block's lowest cosine minus `ABSENT_COSINE_GAP`, one the lexical blocks lack a rank past the pool."""
ABSENT_COSINE_GAP = 0.02
ABSENT_RANK = 50
DENSE = "dense"
LEXICAL_SCORER = "lexical"
DENSE_SCORER = "dense"
CANDIDATE_FEATURES = (
    "stop", "title_query", "name_query", "source_prob", "source_inv_rank", "source_is_anchor",
    "source_title_in_q", "turn", "stop_x_when", "stop_x_where", "stop_x_who", "stop_x_what", "stop_x_which",
    "stop_x_how", "stop_x_qlen", "stop_x_top_prob", "stop_x_anchor_count",
)


class CompactPolicyError(ValueError):
    """A compact policy folder that cannot be served (missing files, digest mismatch, wrong shapes)."""


def _same_encoder(served: str, trained: str | None) -> bool:
    """The retriever's encoder (a name or a local path) is the one the dense scorer was trained with."""
    if not trained:
        return False
    return served == trained or Path(served.rstrip("/")).name == Path(trained.rstrip("/")).name


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _content(text: str) -> set[str]:
    return {w for w in _words(text) if w not in _STOP}


@dataclass
class PoolDoc:
    """One distinct document of the pool, where it was first seen (block index, 1-based position)."""

    doc: SearchedDocument
    block: int
    position: int
    rank: int
    score_rel: float
    score_z: float
    lexical: bool = True
    """Found by a lexical (BM25) block; False: only by the dense block."""


def pool_of(blocks: Sequence[InfoBlock]) -> list[PoolDoc]:
    """The distinct documents of every block (by id, first occurrence kept), with their lexical (BM25)
    evidence relative to their own block: the lexical blocks' documents first, in block order, then those
    only a dense block found (lexical evidence absent: no score, rank `ABSENT_RANK`)."""
    seen: set[str] = set()
    pool: list[PoolDoc] = []
    lexical = [(b, block) for b, block in enumerate(blocks) if block.method != DENSE]
    for b, block in lexical:
        docs = block.documents
        scores = np.array([d.score or 0.0 for d in docs], dtype=np.float64)
        top = float(scores.max()) if len(scores) and scores.max() > 0 else 1.0
        mean, std = (float(scores.mean()), float(scores.std())) if len(scores) else (0.0, 0.0)
        for i, doc in enumerate(docs):
            if doc.id in seen:
                continue
            seen.add(doc.id)
            pool.append(PoolDoc(doc, b, i + 1, i, float(scores[i]) / top, (float(scores[i]) - mean) / (std + 1e-6)))
    for b, block in enumerate(blocks):
        if block.method != DENSE:
            continue
        for i, doc in enumerate(block.documents):
            if doc.id not in seen:
                seen.add(doc.id)
                pool.append(PoolDoc(doc, b, i + 1, ABSENT_RANK, 0.0, -3.0, lexical=False))
    return pool


def dense_features(pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock]) -> np.ndarray | None:
    """One row of `DENSE_FEATURES` per pool document, from the first dense block of the question (None
    when the search has none)."""
    dense = next((block for block in blocks if block.method == DENSE and block.turn == 0), None)
    if dense is None or not dense.documents:
        return None
    found: dict[str, tuple[int, float]] = {}
    for i, doc in enumerate(dense.documents):
        found.setdefault(doc.id, (i, float(doc.score or 0.0)))
    absent = min(score for _, score in found.values()) - ABSENT_COSINE_GAP
    cos = np.array([found[p.doc.id][1] if p.doc.id in found else absent for p in pool], dtype=np.float64)
    in_dense = np.array([float(p.doc.id in found) for p in pool])
    dense_rank = np.array([found[p.doc.id][0] if p.doc.id in found else ABSENT_RANK for p in pool], dtype=np.float64)
    lexical_rank = np.array([p.rank if p.lexical else ABSENT_RANK for p in pool], dtype=np.float64)
    in_lexical = np.array([float(p.lexical) for p in pool])
    rows = np.stack([in_lexical, cos, cos - cos.max(), (cos - cos.mean()) / (cos.std() + 1e-6), in_dense,
                     1.0 / (dense_rank + 1), 1.0 / (lexical_rank + 1)], axis=1)
    return rows.astype(np.float32).reshape(len(pool), len(DENSE_FEATURES))


def _joined(text: str) -> str:
    """Lower-cased words joined by single spaces, padded: `f" {phrase} " in _joined(text)` matches whole words."""
    return f" {' '.join(_words(text))} "


def title_core(title: str) -> str:
    """A title without its trailing "(disambiguation)": "Machine Head (band)" -> "Machine Head"."""
    return _PAREN.sub("", title).strip()


def title_head(title: str) -> str:
    """A title's core before its first comma: "Davenport, Florida" -> "Davenport"."""
    return title_core(title).split(",")[0].strip()


@dataclass
class QuestionInfo:
    text: str
    lower: str
    joined: str
    content: set[str]
    wh: list[float]

    @classmethod
    def of(cls, question: str) -> QuestionInfo:
        joined = _joined(question)
        wh = [float(f" {w} " in joined) for w in WH]
        return cls(question, question.lower(), joined, _content(question), wh)


def doc_features(question: QuestionInfo, pool: Sequence[PoolDoc]) -> np.ndarray:
    """One row of `DOC_FEATURES` per pool document."""
    qw, ql, wh = question.content, question.joined, question.wh
    titles = [_joined(p.doc.title).strip() for p in pool]
    body_words = [_words(p.doc.text) for p in pool]
    bodies = [f" {' '.join(words)} " for words in body_words]  # _joined, from the words read once
    title_words = [_content(p.doc.title) for p in pool]
    title_in_q = [len(tw & qw) / max(1, len(tw)) for tw in title_words]
    anchors = [j for j in range(len(pool)) if titles[j] and (f" {titles[j]} " in ql or title_in_q[j] >= 0.99)]
    window = range(min(LINK_WINDOW, len(pool)))
    cores = [_joined(title_core(p.doc.title)).strip() for p in pool]
    heads = [_joined(title_head(p.doc.title)).strip() for p in pool]
    core_words = [_content(title_core(p.doc.title)) for p in pool]
    core_in_q = [len(c) > 3 and f" {c} " in ql for c in cores]
    core_cov = [len(w & qw) / max(1, len(w)) for w in core_words]
    core_anchors = [j for j in range(len(pool)) if core_in_q[j] or core_cov[j] >= 0.99]
    top3 = range(min(3, len(pool)))
    first_of_core: dict[str, int] = {}
    rows = []
    for i, p in enumerate(pool):
        text = p.doc.text
        words = body_words[i]
        title_ok = len(titles[i]) > 3
        mentioned_by = sum(1 for j in window if j != i and title_ok and f" {titles[i]} " in bodies[j])
        mentions = sum(1 for j in window if j != i and len(titles[j]) > 3 and f" {titles[j]} " in bodies[i])
        linked_from = float(any(j != i and title_ok and f" {titles[i]} " in bodies[j] for j in anchors))
        links_to = float(any(j != i and len(titles[j]) > 3 and f" {titles[j]} " in bodies[i] for j in anchors))
        caps = _CAP.findall(text)
        cap_density = len(caps) / max(1, len(words))
        has_year = float(bool(_YEAR.search(text)))
        has_number = float(bool(_NUM.search(text)))
        new_name = float(any(c.lower() not in qw for c in caps))
        coverage = len(qw & ((set(words) - _STOP) | title_words[i])) / max(1, len(qw))
        core_ok, head_ok = len(cores[i]) > 3, len(heads[i]) > 3
        same_above = first_of_core.setdefault(cores[i], i) != i
        linked = [
            float(i in core_anchors),
            float(any(j != i and core_ok and f" {cores[i]} " in bodies[j] for j in core_anchors)),
            float(any(j != i and head_ok and f" {heads[i]} " in bodies[j] for j in core_anchors)),
            float(any(j != i and len(cores[j]) > 3 and f" {cores[j]} " in bodies[i] for j in core_anchors)),
            float(any(j != i and len(heads[j]) > 3 and f" {heads[j]} " in bodies[i] for j in core_anchors)),
            float(any(j != i and head_ok and f" {heads[i]} " in bodies[j] for j in top3)),
            float(same_above),
            min(sum(1 for j in window if j != i and head_ok and f" {heads[i]} " in bodies[j]), 3) / 3,
        ]
        rows.append([
            p.score_rel, 1.0 / (p.rank + 1), math.log1p(p.rank) / math.log(51), float(p.block > 0),
            title_in_q[i], float(bool(titles[i]) and f" {titles[i]} " in ql), coverage,
            min(mentioned_by, 3) / 3, min(mentions, 3) / 3, has_year, has_number, cap_density,
            wh[0] * has_year, wh[7] * has_year, wh[2] * cap_density, wh[5] * has_number, wh[6] * has_number,
            linked_from, links_to, new_name, max(-3.0, min(3.0, p.score_z)), float(i in anchors),
            float(core_in_q[i]), core_cov[i], *linked, float(bool(core_anchors)), min(len(core_anchors), 3) / 3,
        ])
    return np.asarray(rows, dtype=np.float32).reshape(len(pool), len(DOC_FEATURES))


@dataclass
class Candidate:
    query: str
    kind: str
    """`stop`, `title` (question + a document's title) or `name` (a name a document introduces)."""
    source: int = -1


# A name candidate is a name or a title a person would search: capitalised words (joined by "of", "de", ...)
# within one sentence, without leading or trailing function words; never only function words and date parts;
# a lone word only when the passage also capitalises it inside a sentence (not "Although", "Tickets").
_FUNCTION = _STOP | frozenset(
    "but nor so yet these those also although though however therefore thus hence meanwhile moreover furthermore "
    "nevertheless nonetheless after before during while since until unless because despite following according "
    "about above across against along among around between beyond into onto over through throughout toward "
    "towards under upon within without both each either neither every all any some many most other such only not "
    "no born died later early late former currently today now once if whether instead besides we i you our your "
    "my me him them us here".split())
_DATE_PARTS = frozenset(
    "january february march april may june july august september october november december jan feb mar apr jun "
    "jul aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday sunday first second third "
    "fourth fifth sixth seventh eighth ninth tenth century".split())
_CONNECT = frozenset("of de the von van du la and del der da di le".split())
_ABBREVIATIONS = frozenset("st mt mr mrs ms dr jr sr co inc ltd vs ft gen col lt sgt capt rev prof no".split())
_SENTENCE_END = re.compile(r"([.!?])\s+(?=\S)")
_NAME_WORD = re.compile(r"[^\W_][\w'&.-]*")
_NUMBER = re.compile(r"^\d+(st|nd|rd|th|s)?$")


def _sentences(text: str) -> list[str]:
    """`text` cut at sentence ends (".", "!", "?" then a space), not after an initial or an abbreviation."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        before = text[start:m.start()].split()
        last = (before[-1] if before else "").rstrip(".")
        if m.group(1) == "." and (len(last) <= 1 or last.lower() in _ABBREVIATIONS or "." in last):
            continue  # "J. R. R. Tolkien", "St. Louis", "U.S. Army"
        out.append(text[start:m.start(1)])
        start = m.end()
    out.append(text[start:])
    return out


def _word(token: str) -> str:
    """A token without its trailing punctuation (an initial's or an abbreviation's full stop kept)."""
    token = token.rstrip("'-&")
    bare = token.rstrip(".")
    return token if token.endswith(".") and (len(bare) <= 1 or "." in bare or bare.lower() in _ABBREVIATIONS) \
        else bare


def _capitalised(word: str) -> bool:
    return word[:1].isupper()


def _names_nothing(words: Sequence[str]) -> bool:
    return all(w.lower().rstrip(".") in _FUNCTION or w.lower() in _DATE_PARTS or _NUMBER.match(w) for w in words)


def _names(text: str, known: str) -> list[str]:
    """Names and titles in `text` that `known` (question and title, lower-cased) does not contain: runs of
    capitalised words inside one sentence, cut of leading and trailing function words; a run of only function
    words and date parts ("Although", "October", "In 1990") is none, and a lone word the passage capitalises only
    where a sentence starts ("Tickets") is a common word, not a name."""
    runs: list[tuple[list[str], bool]] = []
    inside: set[str] = set()  # words the text capitalises inside a sentence
    for sentence in _sentences(text):
        tokens = list(_NAME_WORD.finditer(sentence))
        i = 0
        while i < len(tokens):
            word = _word(tokens[i].group(0))
            if not _capitalised(word):
                i += 1
                continue
            parts, end, k = [word], tokens[i].end(), i + 1
            while k < len(tokens) and sentence[end:tokens[k].start()].strip() in ("", "&"):
                nxt = _word(tokens[k].group(0))
                if _capitalised(nxt):
                    parts += ["&", nxt] if sentence[end:tokens[k].start()].strip() == "&" else [nxt]
                    end, k = tokens[k].end(), k + 1
                elif nxt.lower() in _CONNECT and k + 1 < len(tokens) and _capitalised(_word(tokens[k + 1].group(0))) \
                        and not sentence[tokens[k].end():tokens[k + 1].start()].strip() \
                        and not sentence[end:tokens[k].start()].strip():
                    parts += [nxt, _word(tokens[k + 1].group(0))]
                    end, k = tokens[k + 1].end(), k + 2
                else:
                    break
            initial = i == 0
            while parts and (parts[0].lower().rstrip(".") in _FUNCTION or parts[0].lower() in _CONNECT):
                parts.pop(0)
                initial = False
            while parts and (parts[-1].lower().rstrip(".") in _FUNCTION or parts[-1].lower() in _CONNECT):
                parts.pop()
            if parts:
                if not initial:
                    inside.add(parts[0])
                runs.append((parts, initial))
            i = k
    out: list[str] = []
    for parts, initial in runs:
        if _names_nothing(parts) or (len(parts) == 1 and initial and parts[0] not in inside):
            continue
        name = " ".join(parts).strip(" -'")
        if len(name) < 4 or name.lower() in known or name.lower() in _STOP or name in out:
            continue
        out.append(name)
    return out


def candidates(question: QuestionInfo, pool: Sequence[PoolDoc], probs: np.ndarray, seen: set[str],
               doc_x: np.ndarray) -> tuple[list[Candidate], np.ndarray]:
    """The stop and the follow-up queries open now, with one row of `CANDIDATE_FEATURES` each."""
    order = np.argsort(-probs, kind="stable")
    out = [Candidate("", "stop")]
    for j in order:
        if len([c for c in out if c.kind == "title"]) >= MAX_TITLE_CANDIDATES:
            break
        query = f"{question.text} {pool[j].doc.title}".strip()
        if parsing.normalize_query(query) not in seen:
            out.append(Candidate(query, "title", int(j)))
    if len(order):
        top = int(order[0])
        known = f"{question.lower} {pool[top].doc.title.lower()}"
        for name in _names(pool[top].doc.text, known)[:MAX_ENTITY_CANDIDATES]:
            if parsing.normalize_query(name) not in seen:
                out.append(Candidate(name, "name", top))
    wh = question.wh
    top_prob = float(probs[order[0]]) if len(order) else 0.0
    anchor_count = float(doc_x[:, DOC_FEATURES.index("is_anchor")].sum()) if len(doc_x) else 0.0
    qlen = min(1.0, len(question.content) / 20)
    turn = float(len({p.block for p in pool}) - 1)
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(len(order))
    rows = []
    for c in out:
        stop = float(c.kind == "stop")
        src = c.source
        rows.append([
            stop, float(c.kind == "title"), float(c.kind == "name"),
            float(probs[src]) if src >= 0 else 0.0, 1.0 / (ranks[src] + 1) if src >= 0 else 0.0,
            float(doc_x[src, DOC_FEATURES.index("is_anchor")]) if src >= 0 else 0.0,
            float(doc_x[src, DOC_FEATURES.index("title_in_q")]) if src >= 0 else 0.0,
            turn, stop * wh[0], stop * wh[1], stop * wh[2], stop * wh[3], stop * wh[4],
            stop * max(wh[5], wh[6]), stop * qlen, stop * top_prob, stop * min(anchor_count, 3) / 3,
        ])
    return out, np.asarray(rows, dtype=np.float32).reshape(len(out), len(CANDIDATE_FEATURES))


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

    @property
    def model(self) -> str:
        """The `policy_model` of its responses (part of the cache key)."""
        return f"{self.name}@{self.digest[:12]}" if self.digest else self.name

    def search_setting(self) -> dict[str, int]:
        """The setting it was trained in (`retrieve_k`, `select_k`, `max_turns`), from its manifest."""
        recorded = self.manifest.get("search") or self.manifest.get("config") or {}
        return {k: int(recorded[k]) for k in ("retrieve_k", "select_k", "max_turns") if k in recorded}

    # ------------------------------------------------------------------------------------ weights
    @classmethod
    def load(cls, folder: Path) -> CompactPolicy:
        manifest_path, weights_path = folder / MANIFEST_FILE, folder / WEIGHTS_FILE
        if not manifest_path.is_file() or not weights_path.is_file():
            raise CompactPolicyError(f"{folder} is not a compact policy folder (needs {MANIFEST_FILE} and "
                                     f"{WEIGHTS_FILE})")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise CompactPolicyError(f"{manifest_path}: not JSON ({exc})") from exc
        data = weights_path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if manifest.get("weights_sha256") != digest:
            raise CompactPolicyError(f"{weights_path}: sha256 {digest} does not match the manifest's "
                                     f"{manifest.get('weights_sha256')}")
        with np.load(weights_path) as npz:
            weights = {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}
        policy = cls(weights, name=str(manifest.get("name", folder.name)), digest=digest, manifest=manifest,
                     folder=folder)
        policy.check()
        return policy

    def check(self) -> None:
        missing = [k for k in (*MLP_KEYS, *QUERY_KEYS) if k not in self.weights]
        if missing:
            raise CompactPolicyError(f"compact policy weights lack {missing}")
        dense = [k for k in MLP_KEYS if DENSE_PREFIX + k in self.weights]
        if dense and len(dense) != len(MLP_KEYS):
            raise CompactPolicyError(f"compact policy weights have part of the dense scorer ({dense})")
        w = self.weights
        for prefix, n in (("", len(DOC_FEATURES)), (DENSE_PREFIX, len(DOC_FEATURES) + len(DENSE_FEATURES))):
            if prefix and not dense:
                continue
            shapes = w[prefix + "mean"].shape, w[prefix + "std"].shape, w[prefix + "w1"].shape[0]
            if shapes != ((n,), (n,), n):
                raise CompactPolicyError(f"compact policy {prefix or 'lexical_'}scorer weights are for "
                                         f"{w[prefix + 'w1'].shape[0]} document features, this code computes {n}")
        if w["qv"].shape != (len(CANDIDATE_FEATURES),):
            raise CompactPolicyError(f"compact policy query weights are for {w['qv'].shape} candidate features, "
                                     f"this code computes {len(CANDIDATE_FEATURES)}")

    @property
    def has_dense(self) -> bool:
        """Whether it ships the `dense` scorer (it then asks for a dense block where `pool_methods` allows)."""
        return DENSE_PREFIX + "w1" in self.weights

    @property
    def dense_encoder(self) -> str | None:
        """The dense encoder its `dense` scorer was trained with (cosines of another encoder do not fit)."""
        if not self.has_dense:
            return None
        return str((self.manifest.get("dense") or {}).get("encoder") or "") or None

    def pool_methods(self, served: Sequence[str] | None, encoder: str | None) -> list[str] | None:
        """The methods of its first retrieval on a retriever that serves `served` with dense `encoder`: bm25,
        plus dense when it has the dense scorer and the retriever's encoder is the one it was trained with;
        None (the retriever's default method) when the retriever does not say or serves no bm25."""
        if not served or "bm25" not in served:
            return None
        if self.has_dense and DENSE in served and encoder is not None and _same_encoder(encoder, self.dense_encoder):
            return ["bm25", DENSE]
        return ["bm25"]

    def save(self, folder: Path, manifest: dict[str, Any]) -> Path:
        """Write `weights.npz` and `manifest.json` (with the weights' digest) into `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / WEIGHTS_FILE
        arrays: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in self.weights.items()}
        np.savez(path, **arrays)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        manifest = {**manifest, "name": self.name, "weights_sha256": digest,
                    "doc_features": list(DOC_FEATURES), "candidate_features": list(CANDIDATE_FEATURES),
                    **({"dense_features": list(DENSE_FEATURES)} if self.has_dense else {})}
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        self.digest, self.manifest, self.folder = digest, manifest, folder
        return path

    # ------------------------------------------------------------------------------------ scoring
    def doc_logits(self, x: np.ndarray, scorer: str = LEXICAL_SCORER) -> np.ndarray:
        w = self.weights
        pre = DENSE_PREFIX if scorer == DENSE_SCORER else ""
        h = (x - w[pre + "mean"]) / w[pre + "std"]
        h = np.maximum(h @ w[pre + "w1"] + w[pre + "b1"], 0)
        h = np.maximum(h @ w[pre + "w2"] + w[pre + "b2"], 0)
        return (h @ w[pre + "w3"] + w[pre + "b3"]).reshape(-1)

    def features(self, question: QuestionInfo, pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock]
                 ) -> tuple[np.ndarray, np.ndarray, str]:
        """(lexical features, scoring features, scorer): the scoring features add the dense evidence when
        the search has a dense block and the policy its scorer."""
        doc_x = doc_features(question, pool)
        dense_x = dense_features(pool, blocks) if self.has_dense else None
        if dense_x is None:
            return doc_x, doc_x, LEXICAL_SCORER
        return doc_x, np.concatenate([doc_x, dense_x], axis=1), DENSE_SCORER

    def query_logits(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weights["qv"]

    def decide(self, env: SearchEnv, *, rng: np.random.Generator | None = None, temperature: float = 1.0
               ) -> Decision:
        """The next action in `env`: a follow-up search or the end with the selection. Greedy without `rng`;
        with one, the query is drawn from the candidates' softmax and the selection by Plackett-Luce."""
        question = QuestionInfo.of(env.question)
        pool = pool_of(env.blocks)
        doc_x, score_x, scorer = self.features(question, pool, env.blocks)
        logits = self.doc_logits(score_x, scorer) if len(pool) else np.zeros(0, dtype=np.float32)
        cand_x, choice = None, None
        if env.can_search and len(pool):
            cands, cand_x = candidates(question, pool, softmax(logits), env.seen_queries, doc_x)
            q_logits = self.query_logits(cand_x)
            if rng is None:
                choice = int(np.argmax(q_logits))
            else:
                choice = int(rng.choice(len(cands), p=softmax(q_logits, temperature)))
            if cands[choice].kind != "stop":
                return Decision(Action("search", query=cands[choice].query), score_x, cand_x, choice,
                                scorer=scorer)
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
    async def act(self, env: SearchEnv) -> Action:
        return self.decide(env).action

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
