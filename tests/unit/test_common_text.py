"""The sentence rule (plugsearch/common/text.py) that ingest cuts passages by, and why the compact searcher's
follow-up candidates keep a rule of their own (they are names, which initials and abbreviations belong to)."""

from __future__ import annotations

from plugsearch.common.text import sentences, ws
from plugsearch.searcher.compact.candidates import _sentences as candidate_sentences


def test_sentences_end_before_a_capital_or_a_digit() -> None:
    assert sentences("It rained.  Then\u00a0it \u200bsnowed! 2 days later? \"Yes.\" (Done.) and so on.") == [
        "It rained.", "Then it snowed!", "2 days later?", "\"Yes.\"", "(Done.) and so on."]
    assert sentences(" \n ") == [] and ws(" a\u00a0 b\u00ad c ") == "a b c"


def test_the_candidates_rule_keeps_names_whole() -> None:
    text = "The film was directed by Robert A. Stemmle in St. Louis. It starred Heinz Ruhmann."
    assert sentences(text) == ["The film was directed by Robert A.", "Stemmle in St.", "Louis.",
                               "It starred Heinz Ruhmann."]
    assert candidate_sentences(text) == ["The film was directed by Robert A. Stemmle in St. Louis",
                                         "It starred Heinz Ruhmann."]
