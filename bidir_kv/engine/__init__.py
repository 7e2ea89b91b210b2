"""The emulated engine: a protocol-faithful drop-in for ``vllm serve`` + NixlConnector.

Reading path: ``settings`` (every default, once), then ``scheduler`` (the core that
assembles the rest), ``steps`` (the step loop), ``reader`` and ``owner`` (the two sides
of a KV transfer, which ``connector`` carries out through a ``transport`` agent), then
``server`` and ``api`` (the HTTP surface). ``model``, ``compute`` and ``profiles`` are the
emulated model and its costs; ``app`` and ``cli`` start it all.
"""
