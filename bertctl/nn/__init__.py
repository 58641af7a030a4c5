"""The machinery beside the readable model in ``bertctl/model.py``.

- ``attention``: the attention implementations (``sdpa``, ``explicit``, and FlashAttention's varlen
  kernel on packed tokens), chosen by the config's ``attn_implementation``, and the cuDNN policy;
- ``packing``: a padded batch's real tokens as one (T, H) tensor, for ``attn_implementation="unpadded"``;
- ``projections``: the matmuls' own autograd nodes (the input projection that owns its residual, the
  cast-inside linear, the vocabulary-padded MLM projection);
- ``fused``: each sub-layer step through bertctl's fused ops (``bertctl.ops``) or plain PyTorch.
"""
