"""The runtime: one Runner per model, one DecodeState per batch, the decode step, capture,
KV cache and weight residency."""
