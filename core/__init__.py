"""The bottom layer: what every other package of ours shares, importing none of them.

Layout::

    errors.py         the one error tree; each class names its gRPC code and its HTTP status (one table)
    types.py          shared value types: messages, sampling, token results, engine info and counters, weight updates
    toolcall.py       the tool-call vocabulary: ``<tool_call>{...}</tool_call>``, its parser
    grammar.py        ToolGrammar: an environment's tool schemas as one object (the speculation layer's input)
    salt.py           the prefix-cache salt (model, policy version, adapter): one function, used by cache and placement
    layered_config.py the layered config loader every CLI uses (defaults < TOML < env < flags, with provenance)
    tasks.py          owning background tasks (``cancel_and_wait``)

Importing ``core`` sets no environment variable and imports no torch, grpc or httpx.
"""
