"""Blueprints: openai (per-rollout model API), admin (pause/resume/state), health."""
