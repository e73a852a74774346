"""The compact policy's follow-up searches: the candidates open at a step (the stop, a document's title with the
question's words it lacks, a name a document introduces), what a person would type, and one row of
`CANDIDATE_FEATURES` each, built by name."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plugsearch.searcher import parsing
from plugsearch.searcher.compact.features import DOC_FEATURES, PoolDoc
from plugsearch.searcher.compact.text import _STOP, _WORD, QuestionInfo, _words

MAX_ENTITY_CANDIDATES = 2
MAX_TITLE_CANDIDATES = 3
CANDIDATE_FEATURES = (
    "stop", "title_query", "name_query", "source_prob", "source_inv_rank", "source_is_anchor",
    "source_title_in_q", "turn", "stop_x_when", "stop_x_where", "stop_x_who", "stop_x_what", "stop_x_which",
    "stop_x_how", "stop_x_qlen", "stop_x_top_prob", "stop_x_anchor_count",
)


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
_NATIONALITIES = frozenset("""
afghan albanian algerian american andorran angolan argentine argentinian armenian australian austrian azerbaijani
bahamian bahraini bangladeshi barbadian belarusian belgian belizean beninese bhutanese bolivian bosnian
botswanan brazilian british bruneian bulgarian burmese burundian cambodian cameroonian canadian chadian chilean
chinese colombian congolese croatian cuban cypriot czech danish dominican dutch ecuadorian egyptian emirati
english eritrean estonian ethiopian fijian filipino finnish french gabonese gambian georgian german ghanaian
greek grenadian guatemalan guinean guyanese haitian honduran hungarian icelandic indian indonesian iranian iraqi
irish israeli italian ivorian jamaican japanese jordanian kazakh kenyan korean kosovar kuwaiti kyrgyz lao latvian
lebanese liberian libyan lithuanian luxembourgish macedonian malagasy malawian malaysian maldivian malian maltese
mauritanian mauritian mexican moldovan monegasque mongolian montenegrin moroccan mozambican namibian nepalese
nepali nigerian nigerien nicaraguan norwegian omani pakistani palestinian panamanian paraguayan persian peruvian
polish portuguese qatari romanian russian rwandan salvadoran samoan saudi scottish senegalese serbian sierra
singaporean slovak slovakian slovenian somali spanish sudanese surinamese swazi swedish swiss syrian taiwanese
tajik tanzanian thai tibetan togolese tongan trinidadian tunisian turkish turkmen ugandan ukrainian uruguayan
uzbek venezuelan vietnamese welsh yemeni zambian zimbabwean african asian european arab arabic latin hispanic
american-born soviet yugoslav prussian ottoman byzantine roman catalan basque flemish walloon bavarian cornish
breton sicilian neapolitan venetian hebrew yiddish sanskrit hindi urdu bengali punjabi tamil telugu marathi
gujarati kannada malayalam swahili zulu xhosa amharic hausa yoruba igbo tagalog javanese cantonese mandarin
hokkien creole esperanto gaelic celtic norse anglo-saxon caribbean scandinavian nordic baltic balkan slavic
germanic mediterranean oriental pacific atlantic western eastern northern southern central
""".split())
"""Nationality, language and region adjectives: alone, none is a name a person would search ("American")."""

_ABBREVIATIONS = frozenset("st mt mr mrs ms dr jr sr co inc ltd vs ft gen col lt sgt capt rev prof no".split())
_SENTENCE_END = re.compile(r"([.!?])\s+(?=\S)")
_NAME_WORD = re.compile(r"[^\W_][\w'&.-]*")
_NUMBER = re.compile(r"^\d+(st|nd|rd|th|s)?$")
_QUERY_WORD = re.compile(r"[^\W_][\w'&.-]*[^\W_]|[^\W_]")


def _sentences(text: str) -> list[str]:
    """`text` cut at sentence ends (".", "!", "?" then a space), not after an initial or an abbreviation.

    Not the project's sentence rule (`plugsearch.common.text.sentences`, which ingest cuts passages by): that one
    cuts after any full stop before a capital, so "J. R. R. Tolkien" and "Robert A. Stemmle" would lose their
    names (4,501 of the 23,652 shared passages split otherwise), and the packaged policy was trained on this."""
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
    where a sentence starts ("Tickets") or also writes in lower case ("Army" beside "army") is a common word, not a
    name, as is a lone nationality, language or region word ("American", "French")."""
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
    lowered = None
    for parts, initial in runs:
        if _names_nothing(parts) or (len(parts) == 1 and initial and parts[0] not in inside):
            continue
        if len(parts) == 1:
            word = parts[0].lower()
            if word in _NATIONALITIES or word.rstrip("s") in _NATIONALITIES:
                continue  # "American", "French": an adjective, not a name
            if lowered is None:
                lowered = set(_WORD.findall(text))
            if word in lowered:
                continue  # the passage also writes it in lower case: a common word ("Church", "Army")
        name = " ".join(parts).strip(" -'")
        if len(name) < 4 or name.lower() in known or name.lower() in _STOP or name in out:
            continue
        out.append(name)
    return out


def title_query(question: QuestionInfo, title: str) -> str:
    """A follow-up a person would type after finding `title`: the title, then the question's content words it
    does not already hold, in the question's order ("Big Stone Gap (film) city director based"), not the question
    copied with the title appended. BM25 drops the function words either way."""
    have = set(_words(title))
    keywords = [w for w in dict.fromkeys(_QUERY_WORD.findall(question.text))
                if w.lower() not in _STOP and w.lower() not in _FUNCTION and w.lower() not in have]
    return " ".join([title.strip(), *keywords]).strip()


def candidates(question: QuestionInfo, pool: Sequence[PoolDoc], probs: np.ndarray, seen: set[str],
               doc_x: np.ndarray) -> tuple[list[Candidate], np.ndarray]:
    """The stop and the follow-up queries open now, with one row of `CANDIDATE_FEATURES` each."""
    order = np.argsort(-probs, kind="stable")
    out = [Candidate("", "stop")]
    for j in order:
        if len([c for c in out if c.kind == "title"]) >= MAX_TITLE_CANDIDATES:
            break
        query = title_query(question, pool[j].doc.title)
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
    is_anchor, title_in_q = DOC_FEATURES.index("is_anchor"), DOC_FEATURES.index("title_in_q")
    rows = []
    for c in out:
        stop = float(c.kind == "stop")
        src = c.source
        row = {
            "stop": stop, "title_query": float(c.kind == "title"), "name_query": float(c.kind == "name"),
            "source_prob": float(probs[src]) if src >= 0 else 0.0,
            "source_inv_rank": 1.0 / (ranks[src] + 1) if src >= 0 else 0.0,
            "source_is_anchor": float(doc_x[src, is_anchor]) if src >= 0 else 0.0,
            "source_title_in_q": float(doc_x[src, title_in_q]) if src >= 0 else 0.0,
            "turn": turn, "stop_x_when": stop * wh[0], "stop_x_where": stop * wh[1], "stop_x_who": stop * wh[2],
            "stop_x_what": stop * wh[3], "stop_x_which": stop * wh[4], "stop_x_how": stop * max(wh[5], wh[6]),
            "stop_x_qlen": stop * qlen, "stop_x_top_prob": stop * top_prob,
            "stop_x_anchor_count": stop * min(anchor_count, 3) / 3,
        }
        rows.append([row[name] for name in CANDIDATE_FEATURES])
    return out, np.asarray(rows, dtype=np.float32).reshape(len(out), len(CANDIDATE_FEATURES))

