"""Eval registry and runners (``primerl eval``).

Layout::

    registry.py  YAML task registry (name, dataset file or generator, env, grader, metrics, samples, sampling)
    runner.py    tasks x checkpoints through a bridge; each sample's score is a signed verifier verdict
    graders.py   eval graders beyond envhub.graders (grpo-arithmetic: the GRPO demo's rubric)
    cli.py       primerl eval
    tasks.yaml   the shipped tasks (calculator, arith-exact); data/ their dataset files
"""
