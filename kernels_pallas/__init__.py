"""jaxserve.kernels_pallas: ragged paged attention kernels (Pallas) and their jnp reference."""
