"""`plugsearch-index ingest`: documents as files (text, Markdown, HTML, PDF, JSONL passages) into a corpus JSONL.

- `formats`: what a file is (its extension, checked against its first bytes) and reading it with the library
  made for it into a `ParsedDocument` (a title, sections with their heading path, blocks of text); one entry per
  format (`FORMATS`).
- `passages`: cutting a document into passages (sentences packed greedily, never across sections).
- `run`: walking the given paths, the checks (allowed folders, size, duplicates), the progress bar, writing the
  corpus and its report atomically.

Nothing is imported here: the passage type (`passages.Passage`), which the change log and the API use, comes
without the file readers' libraries.
"""
