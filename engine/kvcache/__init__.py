"""KV pool, slot allocator and the radix prefix cache."""
