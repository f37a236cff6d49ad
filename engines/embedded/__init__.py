"""The embedded engine: a Hugging Face model served in-process (torch, CPU or CUDA).

Layout::

    engine.py     EmbeddedEngine: the Engine facade, per-request queues, weight and adapter updates
    spec.py       the speculative step (drafts, one verify forward, acceptance)
    model.py      loading the model and tokenizer (through engines.model_store)
    kvcache.py    the paged prefix KV cache (parked sequences, LRU eviction)
    weights.py    reading and checking safetensors checkpoints for in-place updates
"""
