"""The embedded engine: a Hugging Face model served in-process (torch, CPU or CUDA).

Layout::

    engine.py     EmbeddedEngine: the Engine facade, per-request queues, the worker thread, scoring, weight loads
    scheduler.py  Scheduler: the sequences, the decode batch, parked KV, the speculative step, weight swaps
    model.py      loading the model and tokenizer (through engines.model_store)
    kvcache.py    KV caches that grow in place, left-padded batch packing, the LRU store of parked KV
    weights.py    reading and checking safetensors checkpoints for in-place updates
"""
