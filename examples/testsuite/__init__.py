"""A long-running agent for a pretrained instruct model: each answer goes through a slow,
heavy-tailed test suite, and a failure gets another turn."""
