"""jaxserve.models: functional models built from shared blocks, one module per family
(`families.py` lists them), and their checkpoint loaders.

Kept import-light (no jax at package import) so the host-side pieces (config, tokenizer) load
without an accelerator stack; import the submodules you need.
"""
