"""LLMServeEnv: an OpenEnv environment for learning LLM-serving policies (issue 20).

Layout::

    models.py    ServeAction, ServeObservation, ServeState, EpisodeLog (openenv-core types)
    profiles.py  DistServe cost coefficients (published A100 profile), quantization tiers, GPUs
    tasks.py     static_workload, bursty_workload (MMPP), adversarial_multitenant; seeded workloads
    sim.py       the discrete-time serving simulator (KV from placement.mig.memory)
    episode.py   one episode: simulator + shaped reward + observation
    baselines.py the Agent protocol; random (floor) and heuristic (reference) policies
    agents.py    make_agent: any agent by name (the baselines, ppo.py the trained one, llm.py)
    llm.py       the llm agent: a chat model at $OPENAI_BASE_URL, the heuristic when its reply does not parse
    grader.py    replay an episode log; score in [0, 1] between floor and reference
    env.py       openenv-core Environment; app.py its server; client.py LLMServeEnv (EnvClient)
    cli.py       primerl llmserve serve
"""
