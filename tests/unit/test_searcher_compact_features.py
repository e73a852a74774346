"""The compact policy's document features, computed over the whole pool at once (`doc_columns`: named columns,
each text read once per search through `PoolTexts`), equal a straightforward per-document computation of the
same definitions (below: one row at a time, every text tokenised again for every feature) exactly, on random
pools whose titles and names link their passages, the way a search's pools grow turn after turn."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

import numpy as np

from plugsearch.common.schemas.searcher import SearchedDocument
from plugsearch.searcher.compact import (
    DOC_FEATURES,
    PoolDoc,
    PoolTexts,
    QuestionInfo,
    TextCache,
    doc_features,
    pool_of,
    title_core,
    title_head,
)
from plugsearch.searcher.compact.features import LINK_WINDOW, doc_columns
from plugsearch.searcher.env import InfoBlock

_WORD = re.compile(r"\w+")
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
_NUM = re.compile(r"\b\d+\b")
_CAP = re.compile(r"\b[A-Z][a-z]+")
_STOP = frozenset(
    "a an the of in on at to for and or is was were are be been by with from as that this which who what when "
    "where how did does do whose whom why it its his her their he she they than then there".split())


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _joined(text: str) -> str:
    return f" {' '.join(_words(text))} "


def _content(text: str) -> set[str]:
    return {w for w in _words(text) if w not in _STOP}


def reference_features(question: str, pool: Sequence[PoolDoc]) -> np.ndarray:
    """The features' definitions, one document at a time."""
    qw, ql = _content(question), _joined(question)
    wh = [float(f" {w} " in ql) for w in ("when", "where", "who", "what", "which", "how many", "how much", "year")]
    n = len(pool)
    title = [_joined(p.doc.title).strip() for p in pool]
    core = [_joined(title_core(p.doc.title)).strip() for p in pool]
    head = [_joined(title_head(p.doc.title)).strip() for p in pool]

    def body(j: int) -> str:
        return _joined(pool[j].doc.text)

    def title_in_q(j: int) -> float:
        tw = _content(pool[j].doc.title)
        return len(tw & qw) / max(1, len(tw))

    def core_cov(j: int) -> float:
        cw = _content(title_core(pool[j].doc.title))
        return len(cw & qw) / max(1, len(cw))

    def anchor(j: int) -> bool:
        return bool(title[j]) and (f" {title[j]} " in ql or title_in_q(j) >= 0.99)

    def core_in_q(j: int) -> bool:
        return len(core[j]) > 3 and f" {core[j]} " in ql

    def core_anchor(j: int) -> bool:
        return core_in_q(j) or core_cov(j) >= 0.99

    def holds(phrases: list[str], i: int, j: int) -> bool:
        """Body j holds document i's phrase (as whole words; phrases of 3 characters or fewer never link)."""
        return len(phrases[i]) > 3 and f" {phrases[i]} " in body(j)

    window = range(min(LINK_WINDOW, n))
    anchors = [j for j in range(n) if anchor(j)]
    core_anchors = [j for j in range(n) if core_anchor(j)]
    rows = []
    for i, p in enumerate(pool):
        text, words = p.doc.text, _words(p.doc.text)
        caps = _CAP.findall(text)
        cap_density = len(caps) / max(1, len(words))
        has_year, has_number = float(bool(_YEAR.search(text))), float(bool(_NUM.search(text)))
        row = {
            "score_rel": p.score_rel, "inv_rank": 1.0 / (p.rank + 1), "log_rank": math.log1p(p.rank) / math.log(51),
            "follow_up": float(p.block > 0), "title_in_q": title_in_q(i),
            "title_full_in_q": float(bool(title[i]) and f" {title[i]} " in ql),
            "q_coverage": len(qw & ((set(words) - _STOP) | _content(p.doc.title))) / max(1, len(qw)),
            "mentioned_by": min(sum(holds(title, i, j) for j in window if j != i), 3) / 3,
            "mentions": min(sum(holds(title, j, i) for j in window if j != i), 3) / 3,
            "has_year": has_year, "has_number": has_number, "cap_density": cap_density,
            "when_year": wh[0] * has_year, "year_year": wh[7] * has_year, "who_names": wh[2] * cap_density,
            "how_many_number": wh[5] * has_number, "how_much_number": wh[6] * has_number,
            "linked_from_anchor": float(any(holds(title, i, j) for j in anchors if j != i)),
            "links_to_anchor": float(any(holds(title, j, i) for j in anchors if j != i)),
            "has_new_name": float(any(c.lower() not in qw for c in caps)),
            "score_z": max(-3.0, min(3.0, p.score_z)), "is_anchor": float(anchor(i)),
            "core_in_q": float(core_in_q(i)), "core_coverage": core_cov(i), "is_core_anchor": float(core_anchor(i)),
            "core_linked_from_anchor": float(any(holds(core, i, j) for j in core_anchors if j != i)),
            "head_linked_from_anchor": float(any(holds(head, i, j) for j in core_anchors if j != i)),
            "core_links_to_anchor": float(any(holds(core, j, i) for j in core_anchors if j != i)),
            "head_links_to_anchor": float(any(holds(head, j, i) for j in core_anchors if j != i)),
            "head_linked_from_top3": float(any(holds(head, i, j) for j in range(min(3, n)) if j != i)),
            "same_title_above": float(any(core[j] == core[i] for j in range(i))),
            "head_linked_in_top10": min(sum(holds(head, i, j) for j in window if j != i), 3) / 3,
            "has_core_anchor": float(bool(core_anchors)), "core_anchor_count": min(len(core_anchors), 3) / 3,
        }
        rows.append([row[name] for name in DOC_FEATURES])
    return np.asarray(rows, dtype=np.float32).reshape(n, len(DOC_FEATURES))


VOCAB = ["Machine", "Head", "band", "the", "of", "Davenport", "Florida", "1991", "42", "Oakland", "city", "river",
         "John", "Smith", "was", "born", "in", "film", "directed", "by", "Gap", "Big", "Stone", "Trigiani", "Adriana",
         "and", "de", "la", "Ab", "x", "Élan", "straße"]
WH_WORDS = ["When", "Where", "who", "what", "which", "how many", "how much", "year"]


def random_title(rng: random.Random) -> str:
    title = " ".join(rng.choice(VOCAB) for _ in range(rng.randint(0, 3)))
    r = rng.random()
    if r < 0.2:
        title += f" ({rng.choice(VOCAB)})"
    elif r < 0.35:
        title += f", {rng.choice(VOCAB)}"
    return title


def random_block(rng: random.Random, turn: int, method: str, titles: list[str], n_ids: int) -> InfoBlock:
    docs = []
    for _ in range(rng.randint(0, 35)):
        words = [rng.choice(VOCAB) for _ in range(rng.randint(0, 25))]
        for _ in range(rng.randint(0, 3)):  # name other documents (a title, as written or lower-cased)
            name = rng.choice(titles)
            words.insert(rng.randint(0, len(words)), name.lower() if rng.random() < 0.3 else name)
        docs.append(SearchedDocument(id=f"d{rng.randrange(n_ids)}", title=random_title(rng), text=" ".join(words),
                                     score=round(rng.uniform(0, 10), 3), turn=turn, query="q"))
    return InfoBlock(turn=turn, queries=["q"], documents=docs, method=method)


def test_pool_features_equal_the_per_document_definitions_on_random_pools() -> None:
    rng = random.Random(41)
    nonzero = np.zeros(len(DOC_FEATURES))
    checked = 0
    for _ in range(150):
        titles = [random_title(rng) for _ in range(8)]
        question = " ".join([rng.choice(WH_WORDS), *(rng.choice(VOCAB + titles) for _ in range(rng.randint(1, 8)))])
        blocks = [random_block(rng, 0, "bm25", titles, 60)]
        if rng.random() < 0.7:
            blocks.append(random_block(rng, 0, "dense", titles, 60))
        for turn in (1, 2):
            blocks.append(random_block(rng, turn, "bm25", titles, 60))
        texts = PoolTexts()  # one per search: its pools grow block by block, as the policy's steps see them
        for upto in range(1, len(blocks) + 1):
            pool = pool_of(blocks[:upto])
            expected = reference_features(question, pool)
            got = doc_features(QuestionInfo.of(question), pool, texts)
            assert got.dtype == np.float32 and got.shape == expected.shape
            assert np.array_equal(got, expected), [
                (DOC_FEATURES[c], r) for r, c in np.argwhere(got != expected)[:5]]
            assert np.array_equal(doc_features(QuestionInfo.of(question), pool), expected)  # without a memo
            nonzero += (expected != 0).sum(axis=0)
            checked += len(pool)
    assert checked > 5000
    silent = [name for name, count in zip(DOC_FEATURES, nonzero, strict=True) if count == 0]
    assert not silent, f"the random pools never exercised {silent}"


def test_a_pool_with_an_id_twice_is_read_per_position() -> None:
    rng = random.Random(7)
    titles = [random_title(rng) for _ in range(8)]
    pool = pool_of([random_block(rng, 0, "bm25", titles, 1000)])
    doubled = [*pool, *pool[:6]]  # not what `pool_of` gives, but still one row per entry
    question = "Who directed Big Stone Gap"
    assert np.array_equal(doc_features(QuestionInfo.of(question), doubled), reference_features(question, doubled))


def test_columns_are_named_once_each() -> None:
    rng = random.Random(3)
    pool = pool_of([random_block(rng, 0, "bm25", ["Machine Head (band)"], 40)])
    columns = doc_columns(QuestionInfo.of("When was Machine Head formed?"), pool)
    assert list(columns) == list(DOC_FEATURES)
    assert all(c.shape == (len(pool),) and c.dtype == np.float64 for c in columns.values())
    assert doc_features(QuestionInfo.of("q"), []).shape == (0, len(DOC_FEATURES))


def test_pool_texts_find_phrases_as_whole_words_and_read_each_text_once() -> None:
    texts = PoolTexts()
    docs = [SearchedDocument(id=str(i), title="", text=t, turn=0, query="q") for i, t in enumerate(
        ["Machine Head toured", "machine heads", "the Machine Head band", "Head Machine"])]
    numbers = [texts.text(d).number for d in docs]
    assert texts.bodies_with("machine head") == (1 << numbers[0]) | (1 << numbers[2])
    assert texts.bodies_with("head") == (1 << numbers[0]) | (1 << numbers[2]) | (1 << numbers[3])
    late = texts.text(SearchedDocument(id="9", title="", text="Machine Head again", turn=1, query="q"))
    assert texts.bodies_with("machine head") & (1 << late.number)  # a body read later is looked at too
    assert texts.text(docs[1]) is texts.text(docs[1].model_copy())  # same id, same text: read once
    changed = texts.text(docs[1].model_copy(update={"text": "other"}))
    assert "other" in changed.facts.body  # same id, another text: read again


def test_the_text_cache_reads_a_document_once_across_searches_and_rereads_a_changed_one() -> None:
    cache = TextCache(2)
    first, second = PoolTexts(cache), PoolTexts(cache)
    doc = SearchedDocument(id="a", title="Machine Head (band)", text="Formed in Oakland in 1991.", turn=0, query="q")
    facts = first.text(doc).facts
    assert second.text(doc.model_copy()).facts is facts and (cache.hits, cache.misses) == (1, 1)
    edited = second.text(doc.model_copy(update={"id": "b", "text": "Formed in 1991."})).facts
    assert first.text(doc.model_copy(update={"text": "Another text."})).facts is not facts  # same id, new text
    assert edited.body == " formed in 1991 " and len(cache) == 2
    for i in range(3):
        PoolTexts(cache).text(doc.model_copy(update={"id": str(i)}))
    assert len(cache) == 2  # bounded: the least recently used went first
    off = TextCache(0)
    PoolTexts(off).text(doc)
    assert len(off) == 0 and off.misses == 1


def test_text_words_and_capitalised_words_equal_the_regex_definitions_for_every_character() -> None:
    """`_lower_words` and `_cap_count` read texts through bytes tables (C speed) instead of the regexes that define
    them (`\\w+` lower-cased; `\\b[A-Z][a-z]+`): the same words and counts for every character, each beside ASCII
    letters, digits, spaces, punctuation and itself, at a text's start and inside it."""
    from plugsearch.searcher.compact.text import _cap_count, _has_new_name, _lower_words

    characters = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for start in range(0, len(characters), 1024):
        chunk = characters[start:start + 1024]
        for text in (" ".join(f"a{c}B{c}Cd,{c}.{c}{c}Ef_1" for c in chunk), "".join(chunk)):
            assert _lower_words(text) == _words(text), [hex(ord(c)) for c in chunk[:1]]
            assert _cap_count(text) == len(_CAP.findall(text)), [hex(ord(c)) for c in chunk[:1]]
    names = "Machine Head played at Élan in Oakland; McDonald's"
    assert _has_new_name(names, {"machine", "head", "at", "in", "oakland", "mc"}) is False
    assert _has_new_name(names, {"machine", "head", "oakland"}) is True
    assert _has_new_name("no capitals here", set()) is False
