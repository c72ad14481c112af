"""What the Triton Python models share: the transfer codec, the conversation store, adapter hashes, config."""
