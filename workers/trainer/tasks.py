"""Trainer tasks (filled in by the trainer)."""
