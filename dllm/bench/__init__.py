"""Benchmarks on the bundled tiny models: synthetic tasks, tokenizer, training, ablation runner."""
