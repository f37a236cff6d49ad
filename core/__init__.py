"""The bottom layer: what every other package of ours shares, importing none of them.

Layout::

    errors.py         the one error tree; each class names its gRPC code and its HTTP status (one table)
    errors_grpc.py    its gRPC edge: an exception's grpc.StatusCode, a call aborted with it
    errors_http.py    its HTTP edge: an app's error body as a Starlette JSON response with the status
    types.py          shared value types: messages, sampling, token results, engine info and counters, weight updates
    toolcall.py       the tool-call vocabulary: ``<tool_call>{...}</tool_call>``, its parser
    grammar.py        ToolGrammar: an environment's tool schemas as one object (the speculation layer's input)
    salt.py           the prefix-cache salt (model, policy version, adapter): one function, used by cache and placement
    canonical.py      the canonical JSON of signed content (sorted keys, no whitespace, NaN refused): one function
    layered_config.py the layered config loader every CLI uses (defaults < TOML < env < flags, with provenance)
    tasks.py          owning background tasks (``cancel_and_wait``)

Importing ``core`` or ``core.errors`` sets no environment variable and imports no torch, grpc, starlette
or httpx (the two edges import grpc and starlette: only servers import them).
"""
