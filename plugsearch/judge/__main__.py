"""`python -m plugsearch.judge` / `plugsearch-judge`: settings from env (JUDGE_*), then serve."""

from plugsearch.common.process import entrypoint

worker_app, main = entrypoint("judge")

if __name__ == "__main__":
    main()
