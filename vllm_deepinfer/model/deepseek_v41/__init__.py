"""DeepSeek V4.1-Flash, one concern a file: args (config), rope, attention, compressor,
indexer, moe, engram, hyper_connections, decoder (the layer step), model (the vLLM
model and its weight loading), step (what one forward step carries between layers)."""
