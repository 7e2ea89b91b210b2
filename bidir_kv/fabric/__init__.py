"""Did the KV reads cross the fabric? The NICs' own counters around a measurement.

Reading path: :mod:`~bidir_kv.fabric.counters` first (EFA ``rdma_read_bytes`` and an
interface's ``rx_bytes`` read from sysfs, their deltas, and :func:`gate_fabric`, the
check that the counted bytes cover the KV bytes the reads had to move); then
:mod:`~bidir_kv.fabric.probe` (which counters to read, on this host or on P's host
through the ssh launcher). The hardware tier and ``bidir-kv doctor`` use both
(docs/hardware.md §4).
"""
