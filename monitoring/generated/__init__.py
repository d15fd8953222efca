"""Modules generated from proto/ by grpcio-tools (checked in; see tests).

They import protobuf and gRPC at once: without the ``monitoring`` extra the
import fails here with one line naming it, before the generated code runs.
"""

from bytecp.plugins import missing_extra

try:
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

__all__: list[str] = []
