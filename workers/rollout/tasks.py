"""Rollout tasks (filled in by the collector)."""
