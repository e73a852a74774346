"""The documents and what describes the indexes: the corpus file read, the document store the service returns
documents from, the index manifests and index folders."""
