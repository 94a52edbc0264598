"""A do-nothing endpoint picker: the floor of Python's gRPC stack under Envoy's ext_proc.

    python -m bench.epp_floor --port P --endpoint 127.0.0.1:8001

It answers every ext_proc message at once with the same messages specgate's picker sends for a
plain request (headers, then the whole body with a fixed destination, then the response's
headers skipping its body), on ``grpc.aio`` as the picker is: no parsing, no session, no
decision. ``bench.scaleout`` measures what specgate's picker adds over Envoy round robin as a
ratio to what this one adds (the target: at most 1.5x). Serves gRPC health like the picker, so
Envoy's cluster health checks pass.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # gateway/epp/envoy_config.py's
LB_NAMESPACE = "envoy.lb"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class FixedPicker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, endpoint: str) -> None:
        destination = HeaderValueOption(header=HeaderValue(key=DESTINATION_HEADER, raw_value=endpoint.encode()))
        self.mutation = ext_proc.HeaderMutation(set_headers=[destination], remove_headers=["authorization"])
        self.metadata = Struct()
        self.metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for message in request_iterator:
            which = message.WhichOneof("request")
            if which == "request_headers":
                if message.request_headers.end_of_stream:  # no body (a GET): pick on the headers
                    yield ext_proc.ProcessingResponse(
                        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
                            header_mutation=self.mutation)), dynamic_metadata=self.metadata)
                else:
                    yield ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
            elif which == "request_body":
                if message.request_body.end_of_stream:
                    yield ext_proc.ProcessingResponse(
                        request_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse(
                            header_mutation=self.mutation)), dynamic_metadata=self.metadata)
                else:
                    yield ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
            elif which == "response_headers":
                response = ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
                response.mode_override.response_body_mode = ProcessingMode.NONE  # as the picker for plain
                yield response
            elif which == "response_body":
                yield ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())
            elif which == "request_trailers":
                yield ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
            elif which == "response_trailers":
                yield ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


async def serve(port: int, endpoint: str) -> None:
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(FixedPicker(endpoint), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    for name in ("", "liveness", "readiness", EXT_PROC_SERVICE):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="host:port every request goes to")
    args = parser.parse_args(argv)
    try:
        import uvloop  # the picker's loop (gateway/cli.py runs it on uvloop)

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
