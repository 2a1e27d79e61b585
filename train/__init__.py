"""specdec_kit.train: corpus, tokenizer, feature streaming and the trainers of every draft head (and the demo zoo recipe)."""
