"""Untrusted graders: user code that runs inside the code sandbox under the policy it declares.

A package declares a grader under the ``primerl.graders`` entry point group. What the entry point names
decides where it runs:

- a ``Grader`` object (it has a ``name``; ``envhub.graders.FnGrader``, a ``Rubric``): trusted, called in
  the verifier's process like the built-in graders;
- a plain function ``fn(sample: dict) -> float``: untrusted. Its module's source runs in a fresh
  bubblewrap + seccomp sandbox per verdict (``sandbox.runner.CodeSandbox``) under the policy
  named by the module's ``SANDBOX_POLICY`` (``grader`` when absent; a shipped name or a YAML path), with
  ``GRADER_VERSION`` (``"1"``) as its version. ``sample`` is ``{"trajectory": {...}, "params": {...}}``
  (the request's trajectory JSON and params). The module sees the sandbox's interpreter and standard
  library only, and no network, no writable path but its policy's, no process but its own.

A sandboxed grader is a process, so its deadline is a kill: the verifier cancels the run and the
sandbox SIGKILLs its process group (no thread left grading in the background). Its verdict signs the
digest of the declared policy, as every verdict does.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from typing import Any

from core.errors import FailedPrecondition
from sandbox.config import SandboxConfig
from sandbox.policies import DEFAULT_GRADER_POLICY, SandboxPolicy
from sandbox.runner import CodeSandbox

_MARK = "@@primerl-reward@@ "
_RUNNER = """
import json as _json
_ns = {{"__name__": {module!r}}}
exec(compile({source!r}, {filename!r}, "exec"), _ns)
_value = _ns[{entry!r}](_json.loads({sample!r}))
print({mark!r} + repr(float(_value)), flush=True)
"""


class SandboxedGraderFailed(FailedPrecondition):
    """The sandboxed grader exited without a reward (it raised, was refused by the sandbox, or hit a limit): 422."""

    http_status = 422


class SandboxedGrader:
    """A grader whose ``source`` runs in the sandbox; ``entry`` names its function. Await ``grade``."""

    def __init__(
        self,
        name: str,
        source: str,
        entry: str,
        *,
        version: str = "1",
        sandbox_policy: str | SandboxPolicy = DEFAULT_GRADER_POLICY,
        module: str = "grader",
        config: SandboxConfig | None = None,
    ) -> None:
        self.name = name
        self.source = source
        self.entry = entry
        self.version = version
        self.sandbox_policy = sandbox_policy
        self.module = module
        self._sandbox = CodeSandbox(config, sandbox_policy)

    @classmethod
    def from_function(cls, name: str, fn: Callable[..., Any], config: SandboxConfig | None = None) -> SandboxedGrader:
        """The grader of an entry point that names a plain function: its whole module goes into the sandbox."""
        module = inspect.getmodule(fn)
        if module is None:
            raise TypeError(f"grader {name!r}: cannot find the module of {fn!r}")
        return cls(
            name,
            inspect.getsource(module),
            fn.__name__,
            version=str(getattr(module, "GRADER_VERSION", "1")),
            sandbox_policy=getattr(module, "SANDBOX_POLICY", DEFAULT_GRADER_POLICY),
            module=module.__name__,
            config=config,
        )

    def __call__(self, sample: Any, /) -> float:
        raise TypeError(f"grader {self.name!r} runs in the sandbox: await grade(sample)")

    async def grade(self, sample: dict[str, Any]) -> float:
        """Run the grader on ``sample`` in a fresh sandbox; its reward, or ``SandboxedGraderFailed``."""
        code = _RUNNER.format(
            module=self.module,
            source=self.source,
            filename=f"{self.module}.py",
            entry=self.entry,
            sample=json.dumps(sample, allow_nan=False),
            mark=_MARK,
        )
        result = await self._sandbox.run(code)
        line = next((x for x in reversed(result.stdout.splitlines()) if x.startswith(_MARK)), None)
        if not result.ok or line is None:
            raise SandboxedGraderFailed(f"grader {self.name!r} (sandboxed) gave no reward: {result.describe()[-600:]}")
        reward = float(line.removeprefix(_MARK))
        if not math.isfinite(reward):
            raise SandboxedGraderFailed(f"grader {self.name!r} returned {reward}, not a finite reward")
        return reward


__all__ = ["SandboxedGrader", "SandboxedGraderFailed"]
