"""`python -m services.judge` / `plugsearch-judge`: settings from env (JUDGE_*), then serve."""

from services.common.process import entrypoint

worker_app, main = entrypoint("judge")

if __name__ == "__main__":
    main()
