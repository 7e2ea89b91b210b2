"""``bidir-kv doctor``: the published troubleshooting list as checks (docs/hardware.md §5)."""
