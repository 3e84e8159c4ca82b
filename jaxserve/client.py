"""`jaxserve.client`, the Python gRPC client, kept at its old import path; it lives in
`jaxserve.server.client`."""

from jaxserve.server.client import (DEFAULT_TARGET, AsyncClient, Client, Completion,
                                    build_request, fold, pb2, prompt_logprobs_of,
                                    sampling_to_proto)

__all__ = ["DEFAULT_TARGET", "AsyncClient", "Client", "Completion", "build_request", "fold",
           "pb2", "prompt_logprobs_of", "sampling_to_proto"]
