"""HeteroFold: prefill-free KV-cache transfer across model families (see heterofold/README.md)."""
