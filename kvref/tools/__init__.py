"""The programs above the API: the `kvref` command (cli.py; its inspect, trace and memory reports in
info.py), `kvref bench` (bench.py), `kvref perplexity` (perplexity.py) and what they share (common.py)."""
