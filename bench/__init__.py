"""Benchmarks: each script prints JSON (and a markdown table) on stdout."""
