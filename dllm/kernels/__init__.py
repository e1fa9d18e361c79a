"""Per-step scoring of logits. ``reference`` defines the semantics in plain PyTorch."""
