"""Multi-turn benchmark: workload, streaming client, runner, stats, report, planner.

``bidir-kv bench`` reproduces the published OFF/ON sweep (vLLM's multi-turn
benchmark flags and stats field names); ``report`` draws it; ``plan`` predicts
it from a model config and hardware figures; ``demo`` runs it locally.
"""
