"""Pieces shared by every service and the trainer: errors, settings, app factory, clients, cache."""
