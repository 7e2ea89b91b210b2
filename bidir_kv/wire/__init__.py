"""What crosses between our processes besides vLLM's own fields: names, ids and versions.

Reading path: :mod:`~bidir_kv.wire.versions` first (every wire we define, its current
version and one line per incompatible change), then :mod:`~bidir_kv.wire.ids` (the
type aliases signatures use for request ids, engine ids and block ids), then
:mod:`~bidir_kv.wire.params` (the keys our D adds to vLLM's ``kv_transfer_params``: its
token chain and its lease) and :mod:`~bidir_kv.wire.ports` (vLLM's default ports).

The engine, the router, the config parser and the vLLM connector all read these, and
the connector runs inside vLLM's environment, so this package imports nothing of ours
but ``policy`` and no third-party package. This ``__init__`` imports nothing, so reading
:mod:`~bidir_kv.wire.ids` does not load the rules.
"""
