"""The search backends: BM25 indexes, dense vector stores and their fusion, each one file, named and wired in
one registry (`registry.py`)."""
