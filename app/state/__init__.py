"""Shared state in Redis: key names (keys.py), record schemas (records.py), connections."""
