"""bertctl: BERT (Devlin et al., 2018) pretraining, fine-tuning and embeddings."""

__version__ = "0.1.0"
