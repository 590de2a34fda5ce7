"""The servers clients reach, on the ports the target's flags give."""
from __future__ import annotations

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from target_service.config import TargetConfig
from target_service.front_doors.generation import GENERATION_SERVICE, GenerationDoor
from target_service.front_doors.openai.server import OpenAIServer
from target_service.front_doors.serving import Serving
from target_service.front_doors.validation import GENERATE_METHOD, UndecodableRequests
from target_service.front_doors.vllm_engine.servicer import SERVICE_NAME as VLLM_SERVICE
from target_service.front_doors.vllm_engine.servicer import VLLM_GENERATE_METHOD, VllmEngineDoor
from target_service.metrics import TargetMetrics
from tandem.grpc_server import RunningServer, ServerOptions, start_server
from tandem.tls import BearerTokenInterceptor
from tandem.v1 import generation_pb2, generation_pb2_grpc


def _register(server: grpc.aio.Server, generation: GenerationDoor, vllm: VllmEngineDoor) -> None:
    """Both front doors on one port: Tandem's own, and vLLM's engine protocol for gateways."""
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, server)


class FrontDoors:
    """The servers clients reach: the gRPC port (Generation and VllmEngine), --vllm-grpc-port (VllmEngine
    alone, without the bearer token: for a gateway, which sends none) and --http-port (OpenAI)."""

    def __init__(self, serving: Serving, config: TargetConfig, metrics: TargetMetrics):
        self.serving, self.config, self.metrics = serving, config, metrics
        self.grpc: list[RunningServer] = []
        self.http: OpenAIServer | None = None

    async def start(self) -> None:
        """HTTP first: once the gRPC port reports SERVING, every door is open."""
        config, token = self.config, self.config.read_auth_token()
        generation, vllm = GenerationDoor(self.serving), VllmEngineDoor(self.serving)
        if config.http_port:
            self.http = OpenAIServer(self.serving, self.metrics.registry, token, config.max_message_bytes)
            await self.http.start(config.host, config.http_port, config.server_tls())
        undecodable = UndecodableRequests({GENERATE_METHOD: generation_pb2.GenerateRequest,
                                           VLLM_GENERATE_METHOD: vllm_engine_pb2.GenerateRequest})
        self.grpc.append(await start_server(
            self._options(config.port, config.metrics_port),
            lambda server: _register(server, generation, vllm),
            [GENERATION_SERVICE, VLLM_SERVICE],
            self.metrics.registry,
            # The token is checked first: an unauthenticated caller learns nothing about its request.
            interceptors=[*([BearerTokenInterceptor(token)] if token else []), undecodable],
        ))
        if config.vllm_grpc_port:
            self.grpc.append(await start_server(
                self._options(config.vllm_grpc_port, 0),
                lambda server: vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, server),
                [VLLM_SERVICE], None, interceptors=[undecodable]))

    def _options(self, port: int, metrics_port: int) -> ServerOptions:
        config = self.config
        return ServerOptions(host=config.host, port=port, metrics_port=metrics_port,
                             max_message_bytes=config.max_message_bytes, grace_seconds=config.grace_seconds,
                             tls=config.server_tls())

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
