"""bidir-kv: multi-turn KV reuse for P/D disaggregated LLM serving, made testable.

Reading path: ``docs/architecture.md`` draws the layers. In code, start at the bottom:
``policy`` (every rule, pure), ``wire`` and ``protocol`` (what crosses between
processes), then one runtime: ``router`` (``bidir-kv proxy``) or ``engine`` (the
emulated ``vllm serve`` + NixlConnector); ``connector`` is the same fixes inside real
vLLM. ``topology`` starts nodes of any backend; ``testing`` is the pytest plugin;
``cli`` names every command.
"""

__version__ = "0.1.0"
