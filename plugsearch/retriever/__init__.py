"""Retriever service: BM25 (bm25s, pyserini), dense (sentence-transformers + FAISS), hybrid RRF."""
