"""jaxserve.server: the gRPC front end."""
