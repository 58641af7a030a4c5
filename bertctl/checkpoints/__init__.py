"""Checkpoints, both kinds.

- ``hf``: model directories in Hugging Face's layout (``config.json``, ``model.safetensors``, the
  tokenizer files), read and written: what ``pretrain`` and ``finetune`` publish and what every command
  loads;
- ``training``: a run's resumable state (``OUT/checkpoints/step-N/``: model, optimizer, scheduler,
  RNG states, data position), written atomically in the background.
"""
