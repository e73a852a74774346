"""The offline trainer of the searcher's policies. Its room, by job:

- `plugsearch.trainer.common`: what both trainers share: the question files and their splits (`data`), the one reward
  computer (`rewards`: GBR through the generator and judge, or its LLM-free span-check form, with the naive
  baselines as named options) and its stored baselines (`baseline`), the one evaluation at equal document
  budget (`evaluation`), the retriever in-process (`retrieval`), the services (`upstreams`, `localstack`),
  settings and plots. Every trainer drives `SearchEnv` through the searcher's own driver
  (`plugsearch.searcher.loop.drive`), so rewards and evaluation see the documents the service would return.
- `plugsearch.trainer.compact`: the compact CPU policy (the default searcher): warm start, REINFORCE, the one-command
  run on a user's corpus and questions (`run`), its export.
- `plugsearch.trainer.llm`: the chat LLM policy on TRL (token-level episodes, samplers, GRPO, a supervised warm start,
  LoRA export to llama.cpp; `accelerate/` for several GPUs).
- `plugsearch.trainer.verl`: the same LLM policy trained by veRL on Ray (agent loop, reward, parquet, config check).
- `plugsearch.trainer.cli`: `plugsearch-train`, one module per subcommand.
"""
