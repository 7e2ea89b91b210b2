"""The emulated engine: a protocol-faithful drop-in for ``vllm serve`` + NixlConnector."""
