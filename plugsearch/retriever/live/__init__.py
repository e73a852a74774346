"""Documents changed while serving: the change log (SQLite, its recovery rules), the changes applied over the built
indexes and searched beside them (a module per job), compaction into new generations of index files, and the
`plugsearch-index put / upload / delete / compact / changes` commands."""
