"""The version of the plugsearch distribution (one place: the services report it, the client sends it)."""

__version__ = "0.1.0"
