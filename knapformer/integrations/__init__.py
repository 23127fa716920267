"""Model integrations, imported on demand (never by ``import knapformer``).

Each model family is one module with its packed forward and a
:class:`~knapformer.integrations.family.ModelFamily` adapter, registered by one line in
:mod:`knapformer.integrations.registry` (the tools find families there, by name only):

- :mod:`knapformer.integrations.reference`: the reference DiTs of :mod:`knapformer.models`;
- :mod:`knapformer.integrations.flux`: diffusers ``FluxTransformer2DModel``
  (``pip install 'knapformer[diffusers]'``; :mod:`knapformer.integrations.diffusers` is its old name);
- :mod:`knapformer.integrations.flux2`: diffusers ``Flux2Transformer2DModel`` (diffusers 0.42);
- :mod:`knapformer.integrations.wan`: diffusers ``WanTransformer3DModel`` (Wan 2.x T2V/I2V/FLF2V/TI2V);
- :mod:`knapformer.integrations.qwenimage`: diffusers ``QwenImageTransformer2DModel`` (Qwen-Image,
  -Edit, -Layered);
- :mod:`knapformer.integrations.hunyuanvideo15`: diffusers ``HunyuanVideo15Transformer3DModel``
  (HunyuanVideo 1.5 T2V/I2V); :mod:`knapformer.integrations.hunyuanvideo15_official`: the authors'
  own ``HunyuanVideo_1_5_DiffusionTransformer`` (no registry line: the tools use the diffusers one);
- :mod:`knapformer.integrations.sd3`: diffusers ``SD3Transformer2DModel`` (SD3 Medium, SD3.5 Large);
- :mod:`knapformer.integrations.torchtitan_flux`: torchtitan's ``FluxModel``
  (``pip install 'knapformer[torchtitan]'``).

Trainers: :mod:`knapformer.integrations.automodel` runs NeMo Automodel's diffusion recipe with
the Wan, FLUX.1 and HunyuanVideo 1.5 families (one hook after ``setup()``), and
:mod:`knapformer.integrations.automodel_data` feeds it token-budget batches of mixed sizes and
durations (docs/automodel.md).
"""

__all__: list[str] = []
