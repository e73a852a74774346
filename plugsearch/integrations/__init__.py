"""Retrievers for RAG frameworks, over the public client (`plugsearch.SearchClient` / `AsyncSearchClient`):
each runs one search per query and returns the framework's own documents (text, title, id, score, and the
search's metadata: mode, queries, policy, degraded), blocking or asyncio where the framework has both.

- `plugsearch.integrations.langchain.PlugsearchRetriever`: a LangChain `BaseRetriever`
  (`pip install 'plugsearch[langchain]'`);
- `plugsearch.integrations.llamaindex.PlugsearchRetriever`: a LlamaIndex `BaseRetriever` (`[llamaindex]`);
- `plugsearch.integrations.haystack.PlugsearchRetriever`: a Haystack component (`[haystack]`);
- `plugsearch.integrations.dspy.PlugsearchRM`: a DSPy retriever, `dspy.Retrieve` (`[dspy]`).

A search the searcher refuses or fails (4xx, 5xx) raises the framework's kind of error, with the error
envelope's message and its `status`, `error_type`, `param` and `retry_after`. See docs/integrations.md.
Each module imports its framework, so import only the one you use.
"""
