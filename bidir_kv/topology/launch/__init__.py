"""Placing one node's command on a host and stopping it again: ``ssh`` (OpenSSH client),
``slurm`` (one ``srun`` step per role) and ``kubernetes`` (one pod per role); each takes
the command ``bidir-kv serve``'s builder makes and returns a handle that stops what it
started (:mod:`bidir_kv.topology.launch.remote`)."""
