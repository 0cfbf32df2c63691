"""Everything that executes a model: loading it (a HF directory, id or GGUF file), its weights and CPU kernels,
the paged KV pool and attention, and one packed forward over a ragged batch of forward items."""
