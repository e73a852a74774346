"""`plugsearch-searcher` / `python -m plugsearch.searcher`: the public search service (port 8000)."""

from plugsearch.common.process import entrypoint

worker_app, main = entrypoint("searcher")

if __name__ == "__main__":
    main()
