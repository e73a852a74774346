from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from plugsearch.common.schemas.base import Document, StrictModel, bounded_text, no_nul

Method = Literal["bm25", "dense", "hybrid"]

MAX_QUERY_CHARS = 2048
MAX_BATCH = 4096
MAX_K = 1000
MAX_RESULTS = 40_960
"""Most hits one request may ask for (queries x k): a full batch at k 10, or 40 queries at k 1000. Keeps
one answer to tens of MB whoever asks (the internal token included)."""


def check_results(queries: int, k: int) -> None:
    """The bound on one answer's size: raises ValueError past `MAX_RESULTS` hits."""
    if queries * k > MAX_RESULTS:
        raise ValueError(f"{queries} queries x k {k} = {queries * k} results, over the limit of {MAX_RESULTS} "
                         "per request: send fewer queries or a smaller k")

Query = bounded_text(MAX_QUERY_CHARS)

_UNSENDABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def fit_query(text: str) -> str:
    """`text` as a query `RetrieveRequest` accepts, or "" when nothing searchable is left: control
    characters (NUL included) and lone surrogates become spaces, and the text is cut to `MAX_QUERY_CHARS`
    (at a space near the end when there is one). What a caller builds from free text (a question up to the
    searcher's longer limit, a policy's output) goes through this before it reaches a merged batch, so it
    can never fail the batch's other queries."""
    text = _UNSENDABLE.sub(" ", text).strip()
    if len(text) > MAX_QUERY_CHARS:
        cut = text[:MAX_QUERY_CHARS]
        space = cut.rfind(" ", MAX_QUERY_CHARS - 64)
        text = (cut[:space] if space > 0 else cut).rstrip()
    return text


class RetrieveRequest(StrictModel):
    queries: list[Query] = Field(..., min_length=1, max_length=MAX_BATCH,  # type: ignore[valid-type]
                                 description="a batch of queries, searched together")
    k: int = Field(10, ge=1, le=MAX_K, description="results per query")
    method: Method | None = Field(None, description="bm25 | dense | hybrid; default: the service's")
    methods: list[Method | None] | None = Field(None, max_length=MAX_BATCH, description=(
        "instead of `method`: one method per query (null: the service's default; a query may come twice, e.g. "
        "with bm25 and with dense: both rankings in one round trip); the response then says each query's in "
        "`methods`"))

    @model_validator(mode="after")
    def _check_size(self) -> RetrieveRequest:
        check_results(len(self.queries), self.k)
        if self.methods is not None:
            if self.method is not None:
                raise ValueError("set method or methods, not both")
            if len(self.methods) != len(self.queries):
                raise ValueError(f"methods has {len(self.methods)} entries for {len(self.queries)} queries: "
                                 "one per query")
        return self


class RetrieveResponse(BaseModel):
    method: Method = Field(..., description="the method searched (with `methods` in the request: the first query's)")
    methods: list[Method] | None = Field(None, description="each query's method, when the request set `methods`")
    results: list[list[Document]]
    took_ms: float


MAX_SAMPLE = 4000


class SampleRequest(StrictModel):
    n: int = Field(..., ge=1, le=MAX_SAMPLE, description="passages to draw (all of them, shuffled, when the corpus "
                   "has fewer)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the draw's seed: the same seed, the same passages")


class SampleResponse(BaseModel):
    passages: list[Document] = Field(..., description="passages drawn at random from the served corpus")
    total: int = Field(..., description="passages in the served corpus")
    index_id: str | None = Field(None, description="the identity of the index they were drawn from")


# Changing the served documents (PUT /documents, POST /documents/delete): a document is its passages.
MAX_PUT_DOCUMENTS = 1000
MAX_PUT_PASSAGES = 20_000
MAX_DELETE = 10_000
MAX_DOCUMENT_CHARS = 2_000_000
ID_CHARS = r"[^\x00-\x1f\x7f-\x9f\u2028\u2029]"
DocumentId = Annotated[str, StringConstraints(min_length=1, max_length=512,
                                              pattern=rf"^[^#\s\x00-\x1f\x7f-\x9f\u2028\u2029](?:{ID_CHARS}*[^\s\x00-\x1f\x7f-\x9f\u2028\u2029])?$"),
                       AfterValidator(no_nul)]
"""A document's id: 1 to 512 characters, no control characters or line separators, not starting with `#`, no space
at either end (spaces inside are fine: a file's path, as `plugsearch-index ingest` makes ids, is one); its passages
are `<id>#0`, `<id>#1`, ..."""


DocumentText = Annotated[str, AfterValidator(no_nul)]
"""A title or text of a document put: no NUL character (as every text a request brings)."""


class PassageIn(StrictModel):
    title: DocumentText = Field("", max_length=2048)
    text: DocumentText = Field(..., min_length=1, max_length=MAX_DOCUMENT_CHARS)


class DocumentIn(StrictModel):
    id: DocumentId
    title: DocumentText = Field("", max_length=2048, description="the document's title (each passage's, unless it has "
                                "its own)")
    text: DocumentText | None = Field(None, min_length=1, max_length=MAX_DOCUMENT_CHARS, description=(
        "the document's text, cut into passages of about 100 words at sentence boundaries (as "
        "`plugsearch-index ingest` cuts)"))
    passages: list[PassageIn] | None = Field(None, min_length=1, max_length=MAX_PUT_PASSAGES, description=(
        "the document's passages, ready-cut (instead of `text`)"))

    @model_validator(mode="after")
    def _one_of(self) -> DocumentIn:
        if (self.text is None) == (self.passages is None):
            raise ValueError("give the document's `text` or its `passages`, one of them")
        if self.text is not None and not self.text.strip():
            raise ValueError("the document's text is empty")
        return self


class PutDocumentsRequest(StrictModel):
    documents: list[DocumentIn] = Field(..., min_length=1, max_length=MAX_PUT_DOCUMENTS, description=(
        "documents to add, or to replace (all the passages of a document already served, by its id)"))

    @model_validator(mode="after")
    def _distinct(self) -> PutDocumentsRequest:
        seen: set[str] = set()
        for doc in self.documents:
            if doc.id in seen:
                raise ValueError(f"document id {doc.id!r} is given twice")
            seen.add(doc.id)
        return self


class DeleteDocumentsRequest(StrictModel):
    ids: list[DocumentId] = Field(..., min_length=1, max_length=MAX_DELETE, description=(
        "ids of the documents to delete (every passage of each); an id not served is no error"))


class ChangeResponse(BaseModel):
    seq: int = Field(..., description="the change's number in the log: acknowledged, durable")
    documents: int = Field(..., description="documents put or deleted")
    passages: int = Field(..., description="passages put; for a delete, the passages it removed")
    index_id: str = Field(..., description="the served index's identity after the change (this worker)")
    took_ms: float


# Files put through the API (POST /documents/files): read and cut as `plugsearch-index ingest` reads and cuts them.
MAX_PUT_FILES = 100
"""Files one request may bring. The request body limit (RETRIEVER_MAX_BODY_BYTES, 2 MiB by default) bounds the
bytes, this the per-file work and the answer's size."""
FileName = Annotated[str, StringConstraints(min_length=1, max_length=1024), AfterValidator(no_nul)]


class FileIn(StrictModel):
    name: FileName = Field(..., description=(
        "the file's path, `/`-separated (`reports/q3.pdf`): its extension picks the reader (.txt, .md, .html, "
        ".pdf, .jsonl, ...), its stem is the title of a document without one, and it is the document id by default"))
    content_base64: str = Field(..., description="the file's bytes, base64-encoded (standard alphabet, padded)")
    id: DocumentId | None = Field(None, description=(
        "the document's id (default: `name`); a document already served with this id is replaced whole. Not for a "
        ".jsonl file, whose rows name their documents"))
    title: DocumentText | None = Field(None, max_length=2048, description=(
        "the document's title, instead of the one the file has (or its name)"))


class PutFilesRequest(StrictModel):
    files: list[FileIn] = Field(..., min_length=1, max_length=MAX_PUT_FILES, description=(
        "files to read, cut and put as documents (added, or replacing a served document with the same id)"))
    words: int | None = Field(None, ge=10, le=10_000, description=(
        "about this many words per passage, cut at sentences (default: `plugsearch-index ingest`'s, 100)"))


class FileResult(BaseModel):
    name: str
    id: str | None = Field(None, description="the document's id (null for a .jsonl file: its rows name theirs)")
    status: Literal["put", "skipped"]
    format: str | None = Field(None, description="text | markdown | html | pdf | jsonl (null: no reader takes "
                               "its extension)")
    documents: int = Field(0, description="documents put from this file")
    passages: int = Field(0, description="passages put from this file")
    reason: str | None = Field(None, description="why the file was skipped")
    sha256: str | None = Field(None, description=(
        "the content hash of the document put (what `GET /documents` lists for it; null for a .jsonl file)"))


class PutFilesResponse(BaseModel):
    seq: int | None = Field(..., description="the change's number in the log (null: nothing was put)")
    index_id: str = Field(..., description="the served index's identity after the change (this worker)")
    documents: int = Field(..., description="documents put")
    passages: int = Field(..., description="passages put")
    took_ms: float
    files: list[FileResult] = Field(..., description="each file, in the request's order")


MAX_LIST = 10_000


class ListDocumentsQuery(StrictModel):
    """A query string's parameters: text, so `limit=5` is read as a number (not strict), unknown ones refused."""

    model_config = ConfigDict(extra="forbid", strict=False)

    prefix: str = Field("", max_length=1024, description="only the documents whose ids start with it")
    after: str | None = Field(None, max_length=1024, description="the page after this id (the `next` of the last)")
    limit: int = Field(1000, ge=1, le=MAX_LIST, description="documents per page")


class ListedDocument(BaseModel):
    id: str
    passages: int = Field(..., description="passages served")
    sha256: str = Field(..., description="the document's content hash: sha256 over its passages' digests in order "
                        "(plugsearch/retriever/ingest/passages.py document_hash)")


class DocumentList(BaseModel):
    documents: list[ListedDocument]
    next: str | None = Field(None, description="pass it as `after` for the next page (null: this is the last)")
    index_id: str = Field(..., description="the served index's identity the page was read from")


class IndexState(BaseModel):
    index_id: str = Field(..., description="the served index's identity (the built indexes and the last change)")
    seq: int = Field(..., description="the last change applied (0: none since the build)")


# Search-R1 / veRL search-tool compatible shapes (POST /retrieve in Search-R1's retrieval_server.py).
# A blank query is allowed here (a policy that writes `<search> </search>`): Search-R1's server answers it
# with an empty list instead of failing the whole batch, and a training run must not die on one.
SearchR1Query = Annotated[str, StringConstraints(max_length=MAX_QUERY_CHARS), AfterValidator(no_nul)]


class SearchR1Request(StrictModel):
    queries: list[SearchR1Query] = Field(..., min_length=1, max_length=MAX_BATCH,
                                         description="blank queries get an empty result list")
    topk: int | None = Field(None, ge=1, le=MAX_K)
    return_scores: bool = False

    @model_validator(mode="after")
    def _check_size(self) -> SearchR1Request:
        if self.topk is not None:
            check_results(len(self.queries), self.topk)
        return self


class SearchR1Document(BaseModel):
    id: str
    contents: str


class SearchR1Hit(BaseModel):
    document: SearchR1Document
    score: float


class SearchR1Response(BaseModel):
    result: list[list[SearchR1Hit]] | list[list[SearchR1Document]]
