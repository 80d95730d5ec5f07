"""Model execution both workers share: the CausalLM with its per-session KV caches (lm), the
one-forward multi-session step (packed), tree blocks (tree), the CPU serving path (cpu), the
paged KV cache with prefix caching (paged), one step's packed inputs over it (paged_step) and
the Llama-family forward on it (paged_llama), the worker's model factory (load), the weights'
dtype and float32 logits (precision) and shims over transformers releases (compat)."""
