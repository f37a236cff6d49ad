"""Engines behind HTTP: vLLM, SGLang and TensorRT-LLM servers, each through its documented wire format.

Layout::

    base.py           RemoteEngine: control calls, admission around weight updates, the turn of one generation
    stream.py         StreamReader: opening and reading a generation stream over the replica's client
    edge.py           the client, timeouts, and mapping HTTP failures to the error tree
    wire.py           the wire formats (token ids, logprobs) shared by the servers
    openai_compat.py  OpenAI-compatible completion payloads (vLLM, TRT-LLM)
    vllm.py           vLLM (``/v1/completions`` with token ids), draft verification and scoring
    sglang.py         SGLang (``/generate``)
    trtllm.py         TensorRT-LLM (``trtllm-serve``)
    remote.py         make_remote_engines: one engine per configured URL
"""
