"""The dspine.v1 service over one engine: the public names, gathered from the modules that hold them.

One job per module:

- :mod:`~dspine.cluster.wire_checks`: the request parsed, every field is known;
- :mod:`~dspine.cluster.converters`: protos <-> the engine's plain data;
- :mod:`~dspine.cluster.service`: :class:`DSpineService`, the methods as async
  functions on protos (the standalone server and the Ray replica use it);
- :mod:`~dspine.cluster.grpc_adapter`: :class:`DSpineServicer`, the ``grpc.aio``
  adapter (statuses, spans, drain);
- :mod:`~dspine.cluster.registration`: :func:`add_to_server`.

This module stays because ``dspine.cluster.servicer.add_to_server`` is the import
path that Ray Serve configs name (``grpc_servicer_functions``).
"""

from __future__ import annotations

from .converters import generate_input_data
from .grpc_adapter import DSpineServicer
from .registration import SERVICE_NAME, add_to_server
from .service import DSpineService
from .wire_checks import MalformedMessage, check_wire

__all__ = ["SERVICE_NAME", "DSpineService", "DSpineServicer", "MalformedMessage", "add_to_server", "check_wire",
           "generate_input_data"]
