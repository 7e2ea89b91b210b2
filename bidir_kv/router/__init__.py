"""KV-cache-aware multi-turn router (``bidir-kv proxy``); see ``docs/router.md``."""
