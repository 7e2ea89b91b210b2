"""bidir-kv: multi-turn KV reuse for P/D disaggregated LLM serving, made testable."""

__version__ = "0.1.0"
