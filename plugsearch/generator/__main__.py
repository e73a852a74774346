"""`python -m plugsearch.generator` / `plugsearch-generator`: settings from env (GENERATOR_*), then serve."""

from plugsearch.common.process import entrypoint

worker_app, main = entrypoint("generator")

if __name__ == "__main__":
    main()
