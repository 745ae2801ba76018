"""ExtraModels: a RayFleet's frozen models beside its policy (docs/fleet.md#several-models).

Each extra model (a reward model, a judge) is a fleet of its own, serving under its name and
frozen. A request or update naming it (`model=`) is that fleet's; everything else is the
policy's. An update it holds open is ended by the next commit or abort, and until then the
policy takes no update: one open update at a time, as on an engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hotswap.engine.client.request import DistributedUpdate
from hotswap.fleet.coordinator import Coordinator

F = TypeVar("F", bound=Callable[..., Any])
# What RayFleet itself takes of an extra model's spec; the rest are its EngineConfig kwargs.
FLEET_ARGS = ("replicas", "tp_size", "resources_per_replica", "placement", "placement_group")


def _keyword_model(args: tuple, kwargs: dict) -> str | None:
    return kwargs.get("model")


def _request_model(args: tuple, kwargs: dict) -> str | None:
    update: DistributedUpdate = args[0]
    return update.model


def by_model(method: F, model_of: Callable[[tuple, dict], str | None] = _keyword_model) -> F:
    """An update method run by the fleet of the model it names (the policy's: this one)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: ExtraModels, *args: Any, **kwargs: Any) -> Any:
        target = self._fleet_for(model_of(args, kwargs))
        if target is self:
            if self._open_on is not None:
                raise ValueError(f"an update of model {self._open_on.model_name!r} is open; "
                                 "commit or abort it first")
            return method(self, *args, **kwargs)
        try:
            return getattr(target, name)(*args, **kwargs)
        finally:
            self._open_on = target if target._staged_on is not None else None

    return call  # type: ignore[return-value]


class ExtraModels(Coordinator):
    """What a RayFleet adds for its extra models; the fleet sets `_extras` and `_open_on`
    before it starts them (`_start_extras`)."""

    _extras: dict[str, Any]  # name -> its RayFleet
    _open_on: Any  # the extra model's fleet that holds an update open, or None

    def _start_extras(self, extra_models: dict[str, dict[str, Any]], **shared: Any) -> None:
        """Each extra model as a fleet of this fleet's type, started with `shared` arguments."""
        for name, extra in extra_models.items():
            if name == self.model_name:
                raise ValueError(f"extra_models: {name!r} is the policy's name")
            if not isinstance(extra, dict) or "model_path" not in extra:
                raise ValueError(f"extra_models[{name!r}] must be a dict with a 'model_path'")
            kwargs = dict(extra)
            path = kwargs.pop("model_path")
            fleet_args = {k: kwargs.pop(k) for k in FLEET_ARGS if k in kwargs}
            self._extras[name] = type(self)(path, **fleet_args, **shared, engine_kwargs={
                **kwargs, "served_model_name": name, "frozen": True})

    @property
    def models(self) -> dict[str, Any]:
        """Every model this fleet serves -> the fleet serving it (the policy: this one)."""
        return {self.model_name: self, **self._extras}

    def _fleet_for(self, model: str | None) -> Any:
        if model is None or model == self.model_name:
            return self
        if model not in self._extras:
            raise ValueError(f"model {model!r}: this fleet serves "
                             f"{', '.join(sorted(self.models))}")
        return self._extras[model]

    update_weight_version = by_model(Coordinator.update_weight_version)
    update_weights_from_serialized = by_model(Coordinator.update_weights_from_serialized)
    update_weights_from_disk = by_model(Coordinator.update_weights_from_disk)
    prepare_weights_from_disk = by_model(Coordinator.prepare_weights_from_disk)
    _update_weights_from_distributed = by_model(Coordinator._update_weights_from_distributed,
                                                _request_model)
    _prepare_weights_from_distributed = by_model(
        Coordinator._prepare_weights_from_distributed, _request_model)

    def commit_weight_update(self, weight_version: str | None = None,
                             pause_mode: str | None = None) -> dict:
        """The open update: the policy's, or an extra model's that a call naming it opened."""
        target, self._open_on = self._open_on, None
        if target is not None:
            return target.commit_weight_update(weight_version, pause_mode)
        return super().commit_weight_update(weight_version, pause_mode)

    def abort_weight_update(self) -> dict:
        target, self._open_on = self._open_on, None
        if target is not None:
            return target.abort_weight_update()
        return super().abort_weight_update()
