"""The pytest plugin and helpers shared by every suite (loaded from the root conftest).

Reading path: ``plugin`` (options, markers, tiers, and the fixture modules it loads),
``gating`` (skip or fail a tier) and ``poll`` (the one way tests wait); then the fixtures
of a tier: ``router`` and ``engines`` (unit, integration), ``conformance`` with
``backends`` and ``scenario`` (conformance), ``hardware`` (hardware). ``doubles/`` holds
the stub engine and the relay. Nothing shipped imports this package.
"""
