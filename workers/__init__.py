"""Celery task modules by role: rollout/ (sibling agent runs, chord callbacks), trainer/."""
