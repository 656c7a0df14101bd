"""Training pipelines: VQ tokenizer, AR target and EAGLE drafter (needs the ``train`` extra)."""
