"""Model execution both workers share: the CausalLM with its per-session KV caches (lm), the
one-forward multi-session step (packed), tree blocks (tree), the CPU serving path (cpu), the
worker's model factory (load), the weights' dtype and float32 logits (precision) and shims
over transformers releases (compat)."""
