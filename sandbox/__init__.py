"""The code sandbox: declared policies, the bubblewrap runner, the seccomp deny list, the escape suite.

Layout::

    config.py     SandboxConfig (``[envhub.sandbox]``: isolation, limits, the interpreter)
    policies/     declared policies (YAML, validated, digested): default, grader; ``load_policy``
    seccomp.py    the seccomp-BPF deny list (x86_64), built without libseccomp
    runner.py     CodeSandbox: one fresh process per call under bubblewrap plus rlimits
    check.py      the escape suite (``primerl sandbox check POLICY``)

The env hub's code tools and the verifier's untrusted graders run here; it imports only ``core``.
"""
