"""The demo: reverse a short string, a multi-turn agent with a slow, heavy-tailed tool."""
