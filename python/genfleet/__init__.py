"""genfleet for Python: callers, tool services and managers of a genfleet fleet, over NATS.

Thin over nats-py; the wire protocol (docs/protocol.md) is the contract:

- :class:`Client` submits, enqueues (in a priority band), follows events, reads status and
  results, cancels and answers decisions, as the default tenant or as one it is given;
- :func:`tool` and :class:`ToolService` register Python functions as tools the fleet's models
  call;
- :class:`Manager` follows the signals with a durable consumer and answers decisions;
- :func:`score`, :func:`rank`, :func:`choose` and :class:`PoolView` are the fleet's placement
  rule for requests with an affinity key (:mod:`genfleet.placement`), which a :class:`Client`
  applies to its keyed submits.
"""

from .client import BANDS, Client, check_id, check_tenant, new_id, qualified_id, request
from .errors import GenfleetError, NoWorker
from .manager import Manager
from .placement import DEFAULT_LOAD_FACTOR, Choice, PoolView, WorkerLoad, choose, rank, score
from .tools import Tool, ToolError, ToolService, schema_from_hints, tool

__all__ = [
    "BANDS",
    "Choice",
    "Client",
    "DEFAULT_LOAD_FACTOR",
    "GenfleetError",
    "Manager",
    "NoWorker",
    "PoolView",
    "Tool",
    "ToolError",
    "ToolService",
    "WorkerLoad",
    "check_id",
    "check_tenant",
    "choose",
    "new_id",
    "qualified_id",
    "rank",
    "request",
    "schema_from_hints",
    "score",
    "tool",
]
