"""`jaxserve.client`, the Python gRPC client, kept at its old import path; it lives in
`jaxserve.server.client`."""

from jaxserve.server.client import AsyncClient, Client, Completion, fold, pb2

__all__ = ["AsyncClient", "Client", "Completion", "fold", "pb2"]
