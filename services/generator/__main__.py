"""`python -m services.generator` / `plugsearch-generator`: settings from env (GENERATOR_*), then serve."""

from services.common.process import entrypoint

worker_app, main = entrypoint("generator")

if __name__ == "__main__":
    main()
