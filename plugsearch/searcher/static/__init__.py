"""The search playground's static files (served at `/ui` when `SEARCHER_UI=true`, see `plugsearch.searcher.ui`)."""
