"""LoRA adapters: PEFT loading, a device pool of adapters, and the batched multi-adapter delta."""
