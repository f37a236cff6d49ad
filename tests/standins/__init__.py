"""Stand-in servers for engines that cannot run on this CPU-only machine (SGLang, TensorRT-LLM).

Each speaks its engine's documented HTTP wire format (``../shared/reference/engine_api_contracts.md``),
quirks included, and is backed by any object implementing ``engines.base.Engine`` (the toy engine in
fast tests, the embedded SmolLM2 engine where a real model matters).
"""
