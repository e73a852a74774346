"""The searcher service: s3 / QAgent / naive search loops behind `POST /search`.

`plugsearch.searcher.loop` is the one implementation of the loops; the trainer imports it.
"""
