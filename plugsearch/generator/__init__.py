"""Generator service: the frozen LLM that answers a question from documents (POST /generate)."""
