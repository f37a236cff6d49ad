"""MIG-aware replica placement: which engine replicas to run on which GPUs and MIG slices.

- ``catalog``: GPU types and their MIG profiles and placement rules;
- ``memory``: model architectures and KV budgeting (bundled ``model_configs/``);
- ``config``: fleet and model files, planner options;
- ``inventory``: the fleet as NVML sees it (else the fleet file);
- ``perf``: a replica's throughput on a device;
- ``problem``: the problem (pools, options) and its solutions, shared by the placers;
- ``solver`` (exact ILP, HiGHS) and ``heuristic`` / ``unit_greedy`` / ``configure`` (no solver): the placement;
- ``plan``: a plan and what it renders to (YAML/JSON, launch commands, Helm values, mig-parted
  config, the bridge's replica list); ``endpoints``: that replica list read back, which sizes the
  routing index per replica (``routing.plan_file``);
- ``cli``: ``primerl placement plan|inventory``.
"""
