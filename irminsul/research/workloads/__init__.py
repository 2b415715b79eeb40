"""Agentic workloads from real traces, the reuse census and the recovery benchmark.

trace (JSONL format) -> render (segment-aligned tokens) -> census (prefix / shifted / novel)
                                                       -> recovery (replay through the planner)
builders turn the shipped data (irminsul/data) into traces; patterns rewrite them into the paper's workloads.
See docs/workloads.md.
"""
