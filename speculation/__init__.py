"""Grammar-aware speculation for tool calls (issue 9).

* ``config``: ``SpeculationConfig`` (``Settings.speculation``).
* ``grammar``: an env's tool schemas -> an llguidance matcher of the ``<tool_call>{json}</tool_call>`` block.
* ``drafters``: grammar-forced (fast-forward) and n-gram (prompt-lookup) drafts, span tracking, adaptive
  length and the acceptance gate; ``factory``: one drafter per generation request for the bridge.
* ``constraint``: the opt-in constrained mode (grammar mask inside tool-call spans, FORCED origins).

Exactness lives in ``engines.sampling.verify``; engines that verify (toy, embedded) take
``GenerateRequest.drafter``; the others ignore it and decode plainly.
"""
