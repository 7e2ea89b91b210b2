"""The one exception tree of bidir_kv.

Every error the package raises on purpose derives from :class:`BidirKVError` through
exactly one *area*: a direct subclass of the base, defined in a module named
``errors`` (the areas below, and the client package's own ``ClientError``). A caller
catches one area, or everything of ours, in one ``except``::

    BidirKVError
    ├── ConfigError      a setting or input file we cannot use (ValueError)
    ├── PlanError        inputs that give no plan (ValueError)
    ├── IntakeError      a client's request refused with a 4xx
    ├── EngineError      the emulated engine refused or failed a request
    ├── KVTransferError  kv_transfer_params, notifications, transports, the connector
    ├── RouterError      an engine the router called failed; the conversation store
    ├── TopologyError    a node that cannot start or run here (RuntimeError)
    └── CheckFailure     a test's or a release gate's check did not hold (AssertionError)

HTTP. ``http_status`` and ``error_type`` say how a server answers an error: a class
default per area, overridden by a class or an instance that knows better (an
:class:`~bidir_kv.intake.InputError` carries its 413 or 415). Each server turns them
into its answer in one function: ``bidir_kv.router.failures.error_response_for`` and
``bidir_kv.engine.server.error_response_for``.

Builtin second bases. A class that was a ``ValueError``, ``RuntimeError`` or
``AssertionError`` before the tree existed stays one, so no ``except`` written against
it (ours or a user's) stops matching: ``argparse`` reports a ``type=`` callable's
``ValueError`` as a usage error, the store's entry reader turns any ``ValueError``
(``ProtocolError``) into a ``StoreError``, the campaign's fault steps catch
``RuntimeError`` from node restarts (``ProcessFailed``), and pytest counts an
``AssertionError`` as a failed test rather than a broken one (``WaitTimeout``,
``GateFailure``). Where every member of an area shares the builtin, the area carries it.
"""

from __future__ import annotations

__all__ = [
    "BidirKVError",
    "CheckFailure",
    "ConfigError",
    "EngineError",
    "IntakeError",
    "KVTransferError",
    "PlanError",
    "RouterError",
    "TopologyError",
]


class BidirKVError(Exception):
    """Base of every error bidir_kv raises on purpose."""

    #: the HTTP status a server answers this error with
    http_status: int = 500
    #: the OpenAI-style ``error.type`` of that answer
    error_type: str = "InternalServerError"


class ConfigError(BidirKVError, ValueError):
    """A setting or an input file we cannot use; the message names the key or the file.

    Raised as itself for a bad ``--kv-transfer-config`` (``bidir_kv.config``); below it
    engine profiles, fault settings, tokenizer directories, workload and distribution
    specs, model configs and result directories.
    """

    http_status = 400  # the engine's POST /_emulator/faults with a bad setting
    error_type = "BadRequestError"


class PlanError(BidirKVError, ValueError):
    """Inputs that cannot give a plan; the message says which (the planner and its fits)."""


class IntakeError(BidirKVError):
    """A client's request refused (4xx) before any work: its body, fields, model,
    conversation id or chat messages; the message names the problem."""

    http_status = 400
    error_type = "BadRequestError"


class EngineError(BidirKVError):
    """The emulated engine refused or failed a request, or cannot start."""


class KVTransferError(BidirKVError):
    """Moving KV between engines: ``kv_transfer_params``, the notification wire, the
    transports and the vLLM connector."""


class RouterError(BidirKVError):
    """The router could not serve a turn: an engine it called failed, or its store."""

    http_status = 502
    error_type = "BadGateway"


class TopologyError(BidirKVError, RuntimeError):
    """A node that cannot start or run here: a backend missing, a process that died."""


class CheckFailure(BidirKVError, AssertionError):
    """A check of a test or of a release gate did not hold (an assertion failure)."""
