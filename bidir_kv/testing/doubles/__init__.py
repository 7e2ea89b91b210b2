"""Test doubles: stand-ins for the processes around the router, cheap to start.

Reading path: :mod:`~bidir_kv.testing.doubles.stub_engine` first: a P/D engine that
speaks the HTTP surface of the protocol and moves no KV (router unit tests, the router
benchmark's upstream, ``python -m bidir_kv.testing.doubles.stub_engine``); then
:mod:`~bidir_kv.testing.doubles.relay`: the upstream example proxy's flow on its own
stack, which the router benchmark measures beside ours. ``tools`` may import them;
nothing shipped does.
"""
