"""``bidir-kv campaign``: load, fault and bad-input campaigns on any topology (docs/campaign.md).

Reading path: ``cli`` (the command, one table, the exit code), then ``deploy`` (what the
campaign runs against: a topology it starts or URLs), then one campaign each in
``load``, ``faults`` and ``inputs``; ``client`` sends the requests, ``table`` prints.
"""
