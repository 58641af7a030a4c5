"""The machinery beside the readable model in ``bertctl/model.py``.

- ``attention``: the attention implementations (``sdpa``, ``explicit``, and FlashAttention's varlen
  kernel on packed tokens), chosen by the runtime's ``attn``, and the cuDNN policy;
- ``packing``: a padded batch's real tokens as one (T, H) tensor, for the ``unpadded`` attention;
- ``projections``: the matmuls' own autograd nodes (the input projection that owns its residual, the
  cast-inside linear, the vocabulary-padded MLM projection);
- ``fused``: each sub-layer step through bertctl's fused ops (``bertctl.ops``) or plain PyTorch.
"""
