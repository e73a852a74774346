"""What the compact and the LLM trainers share: data and splits, the one reward computer and its baselines,
the one evaluation, the retriever in-process, the services, settings and plots."""
