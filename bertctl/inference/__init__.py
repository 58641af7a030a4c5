"""Inference: ``embed``'s pipeline and the backends that run a checkpoint's encoder.

- ``embed.py``: the pipeline (read texts, tokenise, batch, run a backend, write vectors);
- ``pooling.py``: ``PoolingSpec``, the one layer and pooling specification every backend reads;
- ``encoder.py``: ``Encoder``, the interface each backend implements, and the ``Tokens`` it takes;
- ``backends/``: PyTorch, ONNX Runtime and bertctl's own CUDA encoder, and which one runs;
- ``sentence_transformers.py``: a sentence-transformers checkpoint's modules, read as ``embed``'s defaults;
- ``onnx_export.py``: ``bertctl export onnx``, a checkpoint's encoder or task head as one ONNX file.
"""
