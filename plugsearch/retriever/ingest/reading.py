"""One file's bytes into passages: the reader its extension picks, the size and content checks, the cut. What
`ingest` reads each file with (in a worker of the parse pool, `plugsearch.retriever.ingest.pool`), and what the
retriever reads a file or a text sent to it with (`POST /documents/files`, `PUT /documents`): the pool's jobs call
these functions, and the walking, the batch and the report (`ingest.run`) call the pool.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from plugsearch.retriever.ingest.formats import FORMATS, SkipFile, extensions, format_of, read_document, sniff
from plugsearch.retriever.ingest.passages import DEFAULT_WORDS, Passage, cut

MB = 1 << 20

ID_RULE = ("1 to 512 characters, no control characters, not starting with '#' nor starting or ending with a "
           "space")


def kind_of(name: str) -> str:
    """The reader `name`'s extension asks for; SkipFile (ignored) for an extension no reader takes."""
    kind = format_of(PurePosixPath(name))
    if kind is None:
        known = ", ".join(extensions())
        raise SkipFile(f"unknown extension {PurePosixPath(name).suffix or '(none)'!r} (ingested: {known})",
                       ignored=True)
    return kind


def read_data(name: str, data: bytes, *, doc_id: str, words: int, max_bytes: int,
              title: str | None = None) -> tuple[str, list[Passage]]:
    """(format, passages) of a file's bytes; SkipFile when it is refused. `name`, `/`-separated, is what the file
    is: its extension picks the reader, it is the passages' `source`, and its stem the title of a document that
    has none (`title`, when given, is the title whatever the document says). What `ingest` reads each file with,
    and the retriever's `POST /documents/files` each file it is sent."""
    kind = kind_of(name)
    if len(data) > max_bytes:
        raise SkipFile(f"too large: {len(data) / MB:,.1f} MB, over the limit of {max_bytes / MB:g} MB per file")
    if not data:
        raise SkipFile("empty file")
    sniff(kind, data[:8192])
    rows = FORMATS[kind].read_passages
    if rows is not None:  # a corpus: its rows are the passages
        return kind, rows(data, name)
    passages = cut_file(kind, data, name=PurePosixPath(name).stem, doc_id=doc_id, source=name, words=words,
                        title=title)
    if not passages:
        raise SkipFile("empty document: no text")
    return kind, passages


def cut_file(kind: str, data: bytes, *, name: str, doc_id: str, source: str, words: int = DEFAULT_WORDS,
             title: str | None = None) -> list[Passage]:
    """A document's bytes read by its format's reader and cut into passages (`<doc_id>#0`, ...): the one read-and-cut
    path of ingest, a file put through the API and a document's text put through the API. `name`: the title when
    the document has none; `title`: the title whatever the document says."""
    document = read_document(kind, data, name)
    if title:
        document.title = title
    return cut(document, doc_id=doc_id, source=source, words=words)


def read_upload(name: str, content_base64: str, *, doc_id: str | None, title: str | None, words: int,
                max_bytes: int) -> tuple[list[Passage], dict[str, str]]:
    """A file sent to the retriever (`POST /documents/files`): its passages, read and cut as `ingest` does
    (`read_data`), and each document's content hash (`passages_hash`); SkipFile when it is refused. A .jsonl
    file's rows are grouped into documents by their ids (`<doc>#<n>`), each document's passages numbered again
    from 0, as `plugsearch-index put` sends them."""
    import base64
    import binascii

    from pydantic import TypeAdapter, ValidationError

    from plugsearch.common.schemas.retriever import MAX_PUT_PASSAGES, DocumentId
    from plugsearch.retriever.ingest.passages import doc_id_of, numbered, passages_hash

    jsonl = FORMATS[kind_of(name)].is_corpus
    if jsonl and (doc_id is not None or title is not None):
        raise SkipFile("a .jsonl file's rows name their own documents and titles: give it no `id` or `title`")
    try:
        data = base64.b64decode("".join(content_base64.split()), validate=True)
    except binascii.Error as exc:
        raise SkipFile(f"content_base64 is not valid base64 ({exc})") from exc
    doc_id = doc_id or name
    _, read = read_data(name, data, doc_id=doc_id, words=words, max_bytes=max_bytes, title=title)
    documents: dict[str, list[tuple[str, str]]] = {}
    for p in read:
        documents.setdefault(doc_id_of(p.id) if jsonl else doc_id, []).append((p.title, p.text))
    check: TypeAdapter[str] = TypeAdapter(DocumentId)
    for doc, parts in documents.items():
        try:
            check.validate_python(doc)
        except ValidationError as exc:
            raise SkipFile(f"{doc!r} is not a document id ({ID_RULE})"
                           + ("" if jsonl else ": give the file an `id`")) from exc
        if len(parts) > MAX_PUT_PASSAGES:
            raise SkipFile(f"document {doc!r} has {len(parts):,} passages, over the limit of {MAX_PUT_PASSAGES:,}")
    passages = [passage for doc, parts in documents.items() for passage in numbered(doc, parts)]
    if not jsonl:  # the file's own passages keep where they came from (its headings, page)
        passages = read
    grouped: dict[str, list[Passage]] = {}
    for passage in passages:
        grouped.setdefault(passage.doc_id, []).append(passage)
    return passages, {doc: passages_hash(group) for doc, group in grouped.items()}
