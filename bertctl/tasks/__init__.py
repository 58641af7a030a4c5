"""Fine-tuning tasks (paper §4): GLUE (``glue``), SQuAD v1.1/v2.0 (``squad``), CoNLL NER (``ner``)
and SWAG (``swag``), on one training loop (``trainer``) and the official metrics (``metrics``)."""
