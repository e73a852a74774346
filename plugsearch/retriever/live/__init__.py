"""Documents changed while serving: the change log, the live overlay over the built indexes, and the
`plugsearch-index put / upload / delete` commands."""
