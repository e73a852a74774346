"""Test support shared by the tests and the benches: fakes, real-process fixtures, tiny corpora. Never imported
by the production packages."""
