"""Continuous batching over one captured burst graph: the loop, its intake and pipeline, JSONL and HTTP."""
