"""Request/response models of every service: the contract between services, clients and the trainer.

Limits live here so that bad input is refused before any work starts.
"""
