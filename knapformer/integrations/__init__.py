"""Integrations with other libraries, imported on demand (never by ``import knapformer``).

- :mod:`knapformer.integrations.diffusers`: packed, balanced training of diffusers'
  ``FluxTransformer2DModel`` (``pip install 'knapformer[diffusers]'``).
"""

__all__: list[str] = []
