"""KV-cache-aware multi-turn router (``bidir-kv proxy``); see ``docs/router.md``.

Reading path: ``settings`` (every default, once), then ``flow`` (one turn: identity,
store, guard, P leg, D leg, what is stored), ``prefill`` and ``decode`` (the legs, with
``failures``), ``relay`` (D's answer on its way to the client), ``memo`` (what a turn
leaves in the store) and ``store/``. ``upstreams`` chooses engines; ``app`` and ``cli``
serve it.
"""
