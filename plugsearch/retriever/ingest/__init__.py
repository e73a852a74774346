"""`plugsearch-index ingest`: documents as files (text, Markdown, HTML, PDF, JSONL passages) into a corpus JSONL.

- `formats`: what a file is (its extension, checked against its first bytes) and reading it with the library
  made for it into a `Document` (a title, sections with their heading path, blocks of text).
- `passages`: cutting a document into passages (sentences packed greedily, never across sections).
- `run`: walking the given paths, the checks (allowed folders, size, duplicates), the progress bar, writing the
  corpus and its report atomically.
"""

from plugsearch.retriever.ingest.run import IngestOptions, IngestReport, ingest

__all__ = ["IngestOptions", "IngestReport", "ingest"]
