"""``bidir-kv campaign``: load, fault and bad-input campaigns on any topology (docs/campaign.md)."""
