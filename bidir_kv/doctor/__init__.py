"""``bidir-kv doctor``: the published troubleshooting list as checks (docs/hardware.md §5).

Reading path: ``checks`` (one function per troubleshooting item, each PASS, WARN or
FAIL with its fix), then ``probe`` (the live two-turn probe that proves a D->P read),
then ``cli`` (which checks run against which nodes).
"""
