"""The compact searcher policy's trainer (`plugsearch.searcher.compact`: a small learned scorer, the default
searcher on the CPU): a supervised warm start, then reinforcement learning with the Gain-Beyond-RAG reward,
both in `SearchEnv`, the environment the searcher serves, driven by the searcher's own driver.

- `config`: the setting (`CompactConfig`, the one source of the command's defaults);
- `data`: the shipped sets' training rows (rows 200+ of nq, hotpotqa, 2wikimultihopqa and popqa; musique,
  bamboogle and triviaqa never) or a user's question files, checked and split by a recorded seed;
- `warmstart`: the demonstrator-labelled warm start; `rl`: REINFORCE with a group baseline and the one reward
  computer (`recall` or `gbr`); `model`: the policy's parameters in torch;
- `run`: `plugsearch-train compact`, the whole run on the shipped data, or on a user's corpus and questions in
  one command: indexes, split, warm start, RL, the evaluation at equal budget with its report and plot, and the
  policy folder with its verdict (`beats_naive`) that `plugsearch-stack --policy DIR` serves.
"""
