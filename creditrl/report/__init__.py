"""Run reports: plots of metrics.jsonl as a self-contained HTML page (and PNGs)."""
